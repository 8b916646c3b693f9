// The C++ front end's checkpoint files. safetensors (torch_mp/checkpoint/safetensors.h): what is
// written is read back exactly, whatever the dtype; a cut file is refused. Checkpoints
// (shards.h, checkpoint.h): a model and its AdamW state saved at one tensor-parallel size load
// exactly at another and back; a missing shard file is named on every rank. (The Python tests
// read these files with the Python front end and the `safetensors` package, and the other way
// round.)

#include "torch_mp/checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/checkpoint/safetensors.h"
#include "torch_mp/layout.h"
#include "torch_mp/tensor_parallel/attention.h"
#include "torch_mp/tensor_parallel/conv_block.h"
#include "torch_mp/tensor_parallel/embedding.h"
#include "torch_mp/tensor_parallel/layer_norm.h"
#include "torch_mp/tensor_parallel/mlp.h"
#include "torch_mp/tensor_parallel/transformer_layer.h"

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

TEST(Shard, BlocksOfAFusedWeightAndOfAPaddedVocabulary) {
  // Q, K and V of 6 rows each over 2 ranks: rank 1 holds rows 3-5 of each.
  Shard qkv{"w", at::empty({9, 4}), 0, 3, std::nullopt, 1, 2};
  ASSERT_EQ(qkv.blocks().size(), 3u);
  EXPECT_EQ(qkv.blocks()[1].local_begin, 3);
  EXPECT_EQ(qkv.blocks()[1].dense_begin, 9);
  EXPECT_EQ(qkv.blocks()[1].length, 3);
  EXPECT_EQ(qkv.dense_shape(), (std::vector<int64_t>{18, 4}));
  // 10 rows over 4 ranks of 3: rank 3 holds row 9 and two rows of padding.
  Shard vocab{"e", at::empty({3, 2}), 0, 1, 10, 3, 4};
  ASSERT_EQ(vocab.blocks().size(), 1u);
  EXPECT_EQ(vocab.blocks()[0].dense_begin, 9);
  EXPECT_EQ(vocab.blocks()[0].length, 1);
  EXPECT_EQ(vocab.dense_shape(), (std::vector<int64_t>{10, 2}));
}

TEST(Shard, LayoutsOfFusedAndChannelShardedTensorsSurviveAClone) {
  testing::run_on_mesh(2, testing::test_options(2), [](const Mesh& mesh) {
    tensor_parallel::ParallelSelfAttention attention(
        tensor_parallel::ParallelSelfAttentionOptions(8, 2).group(mesh.tp_group));
    const auto copy =
        std::dynamic_pointer_cast<tensor_parallel::ParallelSelfAttentionImpl>(attention->clone());
    EXPECT_EQ(layout_of(copy->qkv->weight)->parts, 3);
    EXPECT_EQ(layout_of(copy->qkv->bias)->parts, 3);
    tensor_parallel::ParallelConvBlock block(
        tensor_parallel::ParallelConvBlockOptions(2, 4, 2).group(mesh.tp_group));
    const auto blocks =
        std::dynamic_pointer_cast<tensor_parallel::ParallelConvBlockImpl>(block->clone());
    EXPECT_EQ(layout_of(blocks->norm->running_mean)->shard_dim, 0);
    EXPECT_EQ(layout_of(blocks->norm->weight)->shard_dim, 0);
  });
}

constexpr int64_t kVocab = 7;  // not divisible by 2 or 4: padded rows
constexpr int64_t kHidden = 8;

/// An embedding and a transformer layer, tensor-parallel, built from dense ones drawn with
/// `seed` (the same dense model at every tensor-parallel size).
struct TinyImpl : torch::nn::Module {
  TinyImpl(uint64_t seed, const GroupPtr& group) {
    // The rank threads share the default generator: seed it and draw the dense model as one
    // step, or another rank's draws interleave and the ranks shard different models.
    static std::mutex drawing;
    std::unique_lock<std::mutex> lock(drawing);
    torch::manual_seed(seed);
    torch::nn::Embedding dense_tok(kVocab, kHidden);
    torch::nn::TransformerEncoderLayer dense_layer(
        torch::nn::TransformerEncoderLayerOptions(kHidden, 4).dim_feedforward(16).dropout(0.0));
    lock.unlock();  // (sharding below talks to the other ranks)
    tok = register_module(
        "tok", tensor_parallel::VocabParallelEmbeddingImpl::from_dense(dense_tok, group));
    layer = register_module(
        "layer", tensor_parallel::ParallelTransformerLayerImpl::from_dense(dense_layer, group));
  }
  at::Tensor forward(const at::Tensor& tokens) { return layer->forward(tok(tokens)); }

  tensor_parallel::VocabParallelEmbedding tok = nullptr;
  tensor_parallel::ParallelTransformerLayer layer = nullptr;
};
TORCH_MODULE(Tiny);

/// One AdamW step of `model` on a fixed batch.
void train_step(Tiny& model, torch::optim::AdamW& optimizer) {
  optimizer.zero_grad();
  model->forward(at::arange(8, at::kLong).remainder(kVocab).view({4, 2})).square().sum().backward();
  optimizer.step();
}

std::string temporary_dir(const std::string& name) {
  const auto path = ::testing::TempDir() + "/torch_mp_ckpt_" + name;
  std::filesystem::remove_all(path);
  return path;
}

/// Every tensor of the checkpoint at `path` joined into one dense tensor per name.
TensorMap dense_contents(const std::string& path) {
  TensorMap all;
  for (const char* prefix : {"model/", "optim/"}) {
    const auto file = path + "." + (prefix[0] == 'm' ? "model" : "optim") + ".safetensors";
    consolidate(path, file, prefix);
    for (auto& [name, tensor] : load_file(file)) {
      all[prefix + name] = tensor;
    }
    std::remove(file.c_str());
  }
  return all;
}

/// Loads the checkpoint `from` at tensor-parallel size `tp` into a model of other values, checks
/// the extra it was saved with, then saves it again to `to`.
void reshard(int tp, const std::string& from, const std::string& to) {
  testing::run_on_mesh(tp, testing::test_options(tp), [&](const Mesh& mesh) {
    const auto shared = std::make_shared<Mesh>(mesh);
    Tiny model(1, mesh.tp_group);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    const auto extra = checkpoint::load(from, {{model.ptr()}}, &optimizer, shared);
    EXPECT_EQ(extra.at("step"), "1");
    checkpoint::save(to, {{model.ptr()}}, &optimizer, extra, shared);
  });
}

TEST(Checkpoint, ModelAndAdamWStateReshardExactlyBetweenTensorParallelSizes) {
  const auto saved = temporary_dir("tp2");
  testing::run_on_mesh(2, testing::test_options(2), [&](const Mesh& mesh) {
    Tiny model(0, mesh.tp_group);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    train_step(model, optimizer);
    checkpoint::save(
        saved, {{model.ptr()}}, &optimizer, {{"step", "1"}}, std::make_shared<Mesh>(mesh));
  });
  EXPECT_TRUE(std::filesystem::exists(saved + "/shard-0-1.safetensors"));
  const auto expected = dense_contents(saved);
  // Dense names, as torch::nn::TransformerEncoderLayer's; AdamW's moments and step.
  for (const char* name : {"model/tok.weight",
                           "model/layer.self_attn.in_proj_weight",
                           "model/layer.linear1.weight",
                           "optim/layer.self_attn.in_proj_weight/exp_avg_sq",
                           "optim/tok.weight/step"}) {
    EXPECT_TRUE(expected.count(name)) << name;
  }
  EXPECT_EQ(expected.at("model/tok.weight").size(0), kVocab);
  for (int tp : {1, 4}) {
    const auto again = temporary_dir("again" + std::to_string(tp));
    reshard(tp, saved, again);
    const auto contents = dense_contents(again);
    ASSERT_EQ(contents.size(), expected.size()) << "tp " << tp;
    for (const auto& [name, tensor] : expected) {
      EXPECT_TRUE(contents.at(name).equal(tensor)) << name << " at tp " << tp;
    }
  }
}

TEST(Checkpoint, AMissingShardFileIsNamedOnEveryRank) {
  const auto saved = temporary_dir("missing");
  testing::run_on_mesh(2, testing::test_options(2), [&](const Mesh& mesh) {
    Tiny model(0, mesh.tp_group);
    checkpoint::save(saved, {{model.ptr()}}, nullptr, {}, std::make_shared<Mesh>(mesh));
  });
  std::filesystem::remove(saved + "/shard-0-1.safetensors");
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(2); },
      [&](const Mesh& mesh) {
        Tiny model(0, mesh.tp_group);
        checkpoint::load(saved, {{model.ptr()}}, nullptr, std::make_shared<Mesh>(mesh));
      });
  testing::expect_every_rank_raised(errors, "lacks shard-0-1.safetensors");
}

TEST(Checkpoint, ADenseExportLoadsIntoAnotherLayout) {
  const auto file = temporary_dir("export") + ".safetensors";
  testing::run_on_mesh(2, testing::test_options(2), [&](const Mesh& mesh) {
    Tiny model(0, mesh.tp_group);
    checkpoint::export_dense(file, {{model.ptr()}}, std::make_shared<Mesh>(mesh));
  });
  const auto dense = load_file(file);
  EXPECT_EQ(dense.at("tok.weight").size(0), kVocab);
  testing::run_on_mesh(1, testing::test_options(1), [&](const Mesh& mesh) {
    Tiny expected(0, mesh.tp_group), model(1, mesh.tp_group);
    checkpoint::load_dense(file, {{model.ptr()}}, std::make_shared<Mesh>(mesh));
    const auto want = expected->named_parameters();
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(item.value().equal(want[item.key()])) << item.key();
    }
  });
}

}  // namespace
}  // namespace torch_mp::checkpoint
