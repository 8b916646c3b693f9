// The C++ front end's safetensors files (torch_mp/checkpoint/safetensors.h): what is written is
// read back exactly, whatever the dtype; a cut file is refused. (The Python tests read these
// files with the Python front end and the `safetensors` package, and the other way round.)

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "tensor_checks.h"
#include "torch_mp/checkpoint/safetensors.h"

namespace torch_mp::checkpoint {
namespace {

std::string temporary_path(const std::string& name) {
  return ::testing::TempDir() + "/torch_mp_" + name + ".safetensors";
}

TEST(SafetensorsFile, RoundTripsEveryDtypeAndTheMetadata) {
  const TensorMap tensors{
      {"a", at::randn({3, 4})},
      {"b", at::arange(6, at::kLong).reshape({2, 3})},
      {"c", at::randn({5}).to(at::kBFloat16)},
      {"d", at::randn({2, 2}).to(at::kHalf)},
      {"e", at::empty({0, 4})},
      {"f", at::scalar_tensor(3, at::kLong)},
      {"g", at::randn({4}) > 0},
  };
  const auto path = temporary_path("round_trip");
  save_file(tensors, path, {{"step", "7"}, {"quote \"x\"", "back\\slash"}});
  std::map<std::string, std::string> metadata;
  const auto read = load_file(path, &metadata);
  EXPECT_EQ(metadata.at("step"), "7");
  EXPECT_EQ(metadata.at("quote \"x\""), "back\\slash");
  ASSERT_EQ(read.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    EXPECT_EQ(read.at(name).scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(read.at(name).equal(tensor)) << name;
  }
  std::remove(path.c_str());
}

TEST(SafetensorsFile, ACutFileIsRefusedNamingIt) {
  const auto path = temporary_path("cut");
  save_file({{"w", at::randn({16})}}, path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));
  }
  const auto error = testing::error_of([&] { load_file(path); });
  EXPECT_TRUE(testing::mentions(error, "cut short"));
  EXPECT_TRUE(testing::mentions(error, path));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace torch_mp::checkpoint
