// libFuzzer's entry point for one target of targets.h, chosen by TORCH_MP_FUZZ_TARGET
// (tests/fuzz/CMakeLists.txt builds one fuzzer per target).

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torch_mp::fuzz::TORCH_MP_FUZZ_TARGET(data, size);
}
