#pragma once
// The fuzz targets of the readers of files from elsewhere: each takes any bytes and must return
// normally or raise c10::Error (a refusal), never crash, hang or raise anything else. libFuzzer
// runs them (fuzzer.cpp, `make fuzz`); the C++ tests replay their corpora on every `make test`
// (tests/cpp/checkpoint_fuzz_corpus_test.cpp).

#include <cstddef>
#include <cstdint>

namespace torch_mp::fuzz {

/// JSON (checkpoint/json.h): parsed, written back by json_text and parsed again, which must
/// give the same text.
int json(const uint8_t* data, size_t size);
/// A whole safetensors file (checkpoint/safetensors_header.h: parse_header_of).
int safetensors_header(const uint8_t* data, size_t size);
/// A checkpoint's index.json (checkpoint/index.h: parse_index).
int index(const uint8_t* data, size_t size);

/// A target and the name of its corpus folder (tests/fuzz/corpus/<name>).
struct Target {
  const char* name;
  int (*run)(const uint8_t*, size_t);
};
inline constexpr Target kTargets[] = {
    {"json", json},
    {"safetensors_header", safetensors_header},
    {"index", index},
};

}  // namespace torch_mp::fuzz
