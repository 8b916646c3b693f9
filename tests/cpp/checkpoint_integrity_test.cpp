// Checkpoints that notice corruption (checksum.h, verify.h) and saves in the background
// (async_save.h): CRC-32C agrees with the published check values; a flipped byte in a sharded
// block is refused on every rank naming the file and the tensor, and verify lists exactly the
// damaged blocks; an async save holds the weights of the moment it was called, however the
// training steps that follow change them, and its failure surfaces at wait() on every rank.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/checkpoint/checkpoint.h"
#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/tensor_parallel/linear.h"

namespace torch_mp::checkpoint::integrity {
namespace {

TEST(Crc32c, MatchesThePublishedCheckValues) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');  // RFC 3720, B.4
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  // Continued over pieces, of any length and alignment, as over the whole.
  const std::string text = "the quick brown fox jumps over the lazy dog, twice over";
  for (size_t cut : {0, 1, 7, 8, 13, 40}) {
    EXPECT_EQ(crc32c(text.data() + cut, text.size() - cut, crc32c(text.data(), cut)),
              crc32c(text.data(), text.size()))
        << cut;
  }
  // A long buffer (three-stream chunks where the CPU has the instruction) as its short pieces
  // (one stream each).
  const auto noise = at::randint(256, {100003}, at::kByte);
  const auto* data = noise.data_ptr<uint8_t>();
  uint32_t pieces = 0;
  for (int64_t at = 0; at < noise.numel(); at += 1000) {
    pieces = crc32c(data + at, std::min<int64_t>(1000, noise.numel() - at), pieces);
  }
  EXPECT_EQ(crc32c(data, noise.numel()), pieces);
  EXPECT_EQ(parse_checksum(checksum_text(0x0000beefu)), 0x0000beefu);
  EXPECT_FALSE(parse_checksum("beef").has_value());
}

TEST(AsyncSave, ASnapshotIsACopyThatLaterChangesDoNotReach) {
  auto tensor = at::arange(6, at::kFloat).view({2, 3}).t();  // not contiguous
  const auto copy = snapshot(tensor);
  tensor.add_(1);
  EXPECT_TRUE(copy.equal(at::arange(6, at::kFloat).view({2, 3}).t()));
  EXPECT_TRUE(copy.is_contiguous());
}

/// A column-parallel Linear (sharded over the tensor group) and a LayerNorm (replicated), from
/// dense ones drawn with `seed`.
struct PairImpl : torch::nn::Module {
  PairImpl(uint64_t seed, const GroupPtr& group) {
    static std::mutex drawing;  // the rank threads share the default generator
    std::unique_lock<std::mutex> lock(drawing);
    torch::manual_seed(seed);
    torch::nn::Linear dense(6, 8);
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    lock.unlock();
    fc = register_module(
        "fc",
        tensor_parallel::ColumnParallelLinearImpl::from_dense(
            dense, tensor_parallel::ColumnParallelLinearOptions(6, 8).group(group)));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  tensor_parallel::ColumnParallelLinear fc = nullptr;
  torch::nn::LayerNorm norm = nullptr;
};
TORCH_MODULE(Pair);

void step(Pair& model, torch::optim::AdamW& optimizer) {
  optimizer.zero_grad();
  (model->forward(at::ones({3, 6})).square().sum() + model->norm->weight.sum()).backward();
  optimizer.step();
}

std::string fresh_dir(const std::string& name) {
  const auto path = ::testing::TempDir() + "/torch_mp_integrity_" + name;
  std::filesystem::remove_all(path);
  return path;
}

// Flips one bit in each of four bytes of the tensor `key` of the safetensors file `path`.
void damage(const std::string& path, const std::string& key) {
  const auto header = read_header(path);
  const auto& entry = header.tensors.at(key);
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  for (uint64_t byte = 0; byte < 4; ++byte) {
    const auto offset = static_cast<std::streamoff>(header.data_start + entry.begin + byte);
    file.seekg(offset);
    char value = 0;
    file.read(&value, 1);
    value = static_cast<char>(value ^ 0x40);
    file.seekp(offset);
    file.write(&value, 1);
  }
}

TEST(CheckpointIntegrity, ADamagedBlockIsRefusedOnEveryRankAndVerifyListsIt) {
  const auto path = fresh_dir("damaged");
  testing::run_on_mesh(2, testing::test_options(2), [&](const Mesh& mesh) {
    Pair model(0, mesh.tp_group);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    step(model, optimizer);
    save(path, {{model.ptr()}}, &optimizer, {}, std::make_shared<Mesh>(mesh));
  });
  EXPECT_TRUE(verify(path).corrupt.empty());
  const std::string block = "model/fc.weight@0:4";  // rank 1's rows of the sharded weight
  damage(path + "/shard-0-1.safetensors", block);
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(2); },
      [&](const Mesh& mesh) {
        Pair model(1, mesh.tp_group);
        torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
        load(path, {{model.ptr()}}, &optimizer, std::make_shared<Mesh>(mesh));
      });
  testing::expect_every_rank_raised(errors,
                                    "shard-0-1.safetensors: tensor " + block + " is corrupt");
  const auto report = verify(path, /*threads=*/2);
  ASSERT_EQ(report.corrupt.size(), 1u);
  EXPECT_EQ(report.corrupt[0].file, "shard-0-1.safetensors");
  EXPECT_EQ(report.corrupt[0].key, block);
  EXPECT_EQ(report.corrupt[0].tensor, "model/fc.weight");
  EXPECT_EQ(report.files, 2);
  EXPECT_TRUE(report.unchecked.empty());
}

TEST(CheckpointIntegrity, AnAsyncSaveHoldsTheWeightsOfTheMomentOfTheCall) {
  const auto path = fresh_dir("async");
  std::vector<TensorMap> at_the_call(2);
  testing::run_on_mesh(2, testing::test_options(2), [&](const Mesh& mesh) {
    Pair model(0, mesh.tp_group);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    step(model, optimizer);
    for (const auto& item : model->named_parameters()) {
      at_the_call[mesh.tp_rank()][item.key()] = item.value().detach().clone();
    }
    const auto shared = std::make_shared<Mesh>(mesh);
    auto saving = async_save(path, {{model.ptr()}}, &optimizer, {{"step", "1"}}, shared);
    for (int i = 0; i < 3; ++i) {
      step(model, optimizer);  // while the save writes
    }
    saving->wait();
    EXPECT_TRUE(saving->done());
    // Loaded at the same layout: the weights of the moment of the call, exactly.
    Pair other(1, mesh.tp_group);
    EXPECT_EQ(load(path, {{other.ptr()}}, nullptr, shared).at("step"), "1");
    for (const auto& item : other->named_parameters()) {
      EXPECT_TRUE(item.value().equal(at_the_call[mesh.tp_rank()][item.key()])) << item.key();
    }
  });
  EXPECT_TRUE(verify(path).corrupt.empty());
}

TEST(CheckpointIntegrity, AFailedAsyncSaveRaisesAtWaitOnEveryRank) {
  const auto blocker = fresh_dir("not_a_directory");
  std::ofstream(blocker) << "a file where the checkpoint's parent directory should be";
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(2); },
      [&](const Mesh& mesh) {
        Pair model(0, mesh.tp_group);
        auto saving = async_save(
            blocker + "/ckpt", {{model.ptr()}}, nullptr, {}, std::make_shared<Mesh>(mesh));
        saving->wait();
      });
  testing::expect_every_rank_raised(errors, "torch_mp::checkpoint::save of " + blocker);
  std::filesystem::remove(blocker);
}

}  // namespace
}  // namespace torch_mp::checkpoint::integrity
