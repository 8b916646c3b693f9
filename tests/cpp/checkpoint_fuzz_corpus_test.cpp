// The fuzzers' corpora (tests/fuzz/corpus/<target>: the seeds, and every input a fuzzer ever
// crashed on, kept there) replayed through their targets on every `make test`: each input must
// be read or refused (c10::Error), never crash or raise anything else.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../fuzz/targets.h"

namespace {

namespace fs = std::filesystem;

TEST(CheckpointFuzzCorpus, EveryInputIsReadOrRefused) {
  const fs::path root = fs::path(TORCH_MP_SOURCE_DIR) / "tests" / "fuzz" / "corpus";
  for (const auto& target : torch_mp::fuzz::kTargets) {
    int64_t inputs = 0;
    for (const auto& entry : fs::directory_iterator(root / target.name)) {
      std::ifstream in(entry.path(), std::ios::binary);
      const std::string bytes{std::istreambuf_iterator<char>(in), {}};
      SCOPED_TRACE(entry.path().string());
      EXPECT_NO_THROW(target.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
      ++inputs;
    }
    EXPECT_GT(inputs, 0) << "no corpus for " << target.name;
  }
}

}  // namespace
