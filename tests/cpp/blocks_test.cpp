// ParallelTransformerLayer and ParallelConvBlock against the dense LibTorch modules computed in the
// same thread without any parallelism.

#include "torch_mp/tensor_parallel/blocks.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/transformerlayer.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::ParallelConvBlockImpl;
using tensor_parallel::ParallelTransformerLayerImpl;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

// ---- ParallelTransformerLayer -----------------------------------------------------------------

constexpr int64_t kSeq = 8;
constexpr int64_t kModel = 16;

torch::nn::TransformerEncoderLayer seeded_transformer_layer() {
  torch::nn::TransformerEncoderLayer dense(
      torch::nn::TransformerEncoderLayerOptions(kModel, 4).dim_feedforward(32).dropout(0.0));
  randomise_parameters(*dense, 71, 0.5);
  return dense;
}

/// The layer sharded from a dense one against it. Under sequence parallelism rank r feeds rows
/// [r * s / t, (r + 1) * s / t) of x and gets the same rows of the output and input gradient.
void check_transformer_layer_matches_dense(const Mesh& mesh, bool sequence_parallel) {
  auto dense = seeded_transformer_layer();
  const at::Tensor input = at::randn({kSeq, 2, kModel}, seeded_generator(72));
  const at::Tensor upstream = at::randn({kSeq, 2, kModel}, seeded_generator(73));
  const at::Tensor dense_x = input.clone().requires_grad_(true);
  const at::Tensor dense_y = dense(dense_x);
  dense_y.backward(upstream);

  auto layer = ParallelTransformerLayerImpl::from_dense(dense, mesh.tp_group, sequence_parallel);
  const auto rows = [&](const at::Tensor& full) {
    return sequence_parallel ? chunk_of(full, 0, mesh) : full;
  };
  const at::Tensor x = rows(input).clone().requires_grad_(true);
  const at::Tensor y = layer(x);
  y.backward(rows(upstream));

  const std::string where = std::string(sequence_parallel ? "sequence parallel" : "replicated") +
                            ", rank " + std::to_string(mesh.rank);
  EXPECT_TRUE(close(y, rows(dense_y))) << "output, " << where;
  EXPECT_TRUE(close(x.grad(), rows(dense_x.grad()))) << "input grad, " << where;
  // Replicated parameters: the whole dense gradient on every rank.
  EXPECT_TRUE(close(layer->norm1->weight.grad(), dense->norm1->weight.grad()))
      << "norm1 weight grad, " << where;
  EXPECT_TRUE(close(layer->norm1->bias.grad(), dense->norm1->bias.grad()))
      << "norm1 bias grad, " << where;
  EXPECT_TRUE(close(layer->norm2->weight.grad(), dense->norm2->weight.grad()))
      << "norm2 weight grad, " << where;
  EXPECT_TRUE(close(layer->self_attn->proj->bias.grad(), dense->self_attn->out_proj->bias.grad()))
      << "attention output bias grad, " << where;
  // This rank's heads: rows [r h / t, (r + 1) h / t) of each of Q, K and V.
  const at::Tensor qkv_grad = dense->self_attn->in_proj_weight.grad().view({3, kModel, kModel});
  EXPECT_TRUE(close(layer->self_attn->qkv->weight.grad(),
                    chunk_of(qkv_grad, 1, mesh).reshape({-1, kModel})))
      << "qkv weight grad, " << where;
  EXPECT_TRUE(close(layer->self_attn->proj->weight.grad(),
                    chunk_of(dense->self_attn->out_proj->weight.grad(), 1, mesh)))
      << "attention output weight grad, " << where;
  EXPECT_TRUE(
      close(layer->mlp->fc1->weight.grad(), chunk_of(dense->linear1->weight.grad(), 0, mesh)))
      << "fc1 weight grad, " << where;
  EXPECT_TRUE(
      close(layer->mlp->fc2->weight.grad(), chunk_of(dense->linear2->weight.grad(), 1, mesh)))
      << "fc2 weight grad, " << where;
}

TEST_P(TensorParallel, TransformerLayerFromDenseMatchesDenseOutputAndGradients) {
  on_every_rank(world(), [](const Mesh& mesh) {
    check_transformer_layer_matches_dense(mesh, /*sequence_parallel=*/false);
  });
}

TEST_P(TensorParallel, SequenceParallelTransformerLayerMatchesTheDenseRowsItHolds) {
  on_every_rank(world(), [](const Mesh& mesh) {
    check_transformer_layer_matches_dense(mesh, /*sequence_parallel=*/true);
  });
}

TEST_P(TensorParallelOnSeveralRanks, TransformerLayerRaisesWhenHeadsAreNotDivisible) {
  expect_every_rank_raises(
      world(),
      [](const Mesh& mesh) {
        const torch::nn::TransformerEncoderLayer dense(
            torch::nn::TransformerEncoderLayerOptions(12, 3).dim_feedforward(24).dropout(0.0));
        ParallelTransformerLayerImpl::from_dense(dense, mesh.tp_group);
      },
      "num_heads (3) must be divisible");
}

// ---- ParallelConvBlock ------------------------------------------------------------------------

/// BatchNorm2d over the middle channels with drawn affine parameters and running statistics and a
/// non-default momentum, so that from_dense must carry all of them over.
torch::nn::BatchNorm2d seeded_batch_norm() {
  torch::nn::BatchNorm2d norm(torch::nn::BatchNorm2dOptions(kConvMid).momentum(0.2));
  at::NoGradGuard no_grad;
  auto generator = seeded_generator(83);
  norm->weight.uniform_(0.5, 1.5, generator);
  norm->bias.uniform_(-0.5, 0.5, generator);
  norm->running_mean.normal_(0.0, 1.0, generator);
  norm->running_var.uniform_(0.5, 1.5, generator);
  return norm;
}

TEST_P(TensorParallel, ConvBlockFromDenseMatchesDenseInTraining) {
  on_every_rank(world(), [](const Mesh& mesh) {
    auto conv1 = seeded_conv(torch::nn::Conv2dOptions(kConvIn, kConvMid, 3).padding(1), 81);
    auto conv2 = seeded_conv(torch::nn::Conv2dOptions(kConvMid, kConvOut, 3).padding(1), 82);
    auto norm = seeded_batch_norm();
    const at::Tensor input = conv_input();
    const at::Tensor upstream = at::randn({2, kConvOut, 20, 11}, seeded_generator(84));

    // Sharded first: the dense forward moves the running statistics.
    auto block = ParallelConvBlockImpl::from_dense(conv1, norm, conv2, mesh.tp_group);
    const at::Tensor dense_x = input.clone().requires_grad_(true);
    const at::Tensor dense_y = conv2(at::relu(norm(conv1(dense_x))));
    dense_y.backward(upstream);
    const at::Tensor x = input.clone().requires_grad_(true);
    const at::Tensor y = block(x);
    y.backward(upstream);

    const std::string where = "rank " + std::to_string(mesh.rank);
    EXPECT_TRUE(close(y, dense_y)) << "output, " << where;
    EXPECT_TRUE(close(x.grad(), dense_x.grad())) << "input grad, " << where;
    EXPECT_TRUE(close(block->conv1->weight.grad(), chunk_of(conv1->weight.grad(), 0, mesh)))
        << "conv1 weight grad, " << where;
    EXPECT_TRUE(close(block->conv1->bias.grad(), chunk_of(conv1->bias.grad(), 0, mesh)))
        << "conv1 bias grad, " << where;
    EXPECT_TRUE(close(block->conv2->weight.grad(), chunk_of(conv2->weight.grad(), 1, mesh)))
        << "conv2 weight grad, " << where;
    EXPECT_TRUE(close(block->conv2->bias.grad(), conv2->bias.grad()))
        << "conv2 bias grad, " << where;
    EXPECT_TRUE(close(block->norm->weight.grad(), chunk_of(norm->weight.grad(), 0, mesh)))
        << "norm weight grad, " << where;
    EXPECT_TRUE(close(block->norm->bias.grad(), chunk_of(norm->bias.grad(), 0, mesh)))
        << "norm bias grad, " << where;
    EXPECT_TRUE(close(block->norm->running_mean, chunk_of(norm->running_mean, 0, mesh)))
        << "running_mean, " << where;
    EXPECT_TRUE(close(block->norm->running_var, chunk_of(norm->running_var, 0, mesh)))
        << "running_var, " << where;
  });
}

TEST_P(TensorParallel, BlocksShardTheDenseModulesOfTorchMpAndLibTorch) {
  on_every_rank(world(), [](const Mesh& mesh) {
    const std::string where = "rank " + std::to_string(mesh.rank);
    // dense::MLP -> ParallelMLP.
    dense::MLP mlp(dense::MLPOptions(8, 16).activation("relu"));
    randomise_parameters(*mlp, 91, 0.5);
    auto parallel_mlp = tensor_parallel::ParallelMLPImpl::from_dense(
        mlp, tensor_parallel::ParallelMLPOptions(8, 16).group(mesh.tp_group));
    const at::Tensor x = at::randn({5, 2, 8}, seeded_generator(92));
    EXPECT_EQ(parallel_mlp->options.activation(), "relu") << where;
    EXPECT_TRUE(close(parallel_mlp(x), mlp(x))) << "MLP output, " << where;

    // dense::ConvBlock -> ParallelConvBlock (evaluation mode: running statistics).
    dense::ConvBlock block(dense::ConvBlockOptions(kConvIn, kConvMid, kConvOut));
    randomise_parameters(*block, 93, 0.5);
    block->eval();
    auto parallel_block = tensor_parallel::ParallelConvBlockImpl::from_dense(block, mesh.tp_group);
    parallel_block->eval();
    const at::Tensor images = conv_input();
    EXPECT_TRUE(close(parallel_block(images), block(images))) << "conv block output, " << where;

    // MultiheadAttention -> ParallelSelfAttention -> back.
    torch::nn::MultiheadAttention attention(torch::nn::MultiheadAttentionOptions(16, 4));
    randomise_parameters(*attention, 94, 0.5);
    auto parallel_attention = tensor_parallel::ParallelSelfAttentionImpl::from_dense(
        attention, tensor_parallel::ParallelSelfAttentionOptions(16, 4).group(mesh.tp_group));
    const at::Tensor tokens = at::randn({6, 2, 16}, seeded_generator(95));
    const auto [expected, weights] = attention(tokens, tokens, tokens);
    EXPECT_TRUE(close(parallel_attention(tokens), expected)) << "attention output, " << where;
    const auto back = parallel_attention->to_dense();
    EXPECT_TRUE(at::equal(back->in_proj_weight, attention->in_proj_weight)) << where;
    EXPECT_TRUE(at::equal(back->out_proj->weight, attention->out_proj->weight)) << where;
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         TensorParallel,
                         ::testing::Values(1, 2, 4),
                         testing::world_size_name);

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         TensorParallelOnSeveralRanks,
                         ::testing::Values(2, 4),
                         testing::world_size_name);

}  // namespace
}  // namespace torch_mp
