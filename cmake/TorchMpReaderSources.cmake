# The readers of files from elsewhere: JSON, safetensors headers, a checkpoint's index. They
# need c10 alone, so that the fuzzers (tests/fuzz, `make fuzz`) build just them; the core's
# sources (CMakeLists.txt) include them.
set(TORCH_MP_READER_SOURCES
  csrc/torch_mp/checkpoint/checksum.cpp
  csrc/torch_mp/checkpoint/index.cpp
  csrc/torch_mp/checkpoint/json.cpp
  csrc/torch_mp/checkpoint/safetensors_header.cpp
)
