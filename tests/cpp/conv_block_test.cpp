// ParallelConvBlock against the dense modules computed in the same thread without any
// parallelism.

#include "torch_mp/tensor_parallel/conv_block.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>

#include <string>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::ParallelConvBlockImpl;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

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

TEST_P(TensorParallel, ConvBlockShardsTorchMpsDenseConvBlockInEvaluation) {
  on_every_rank(world(), [](const Mesh& mesh) {
    const std::string where = "rank " + std::to_string(mesh.rank);
    // dense::ConvBlock -> ParallelConvBlock (evaluation mode: running statistics).
    dense::ConvBlock block(dense::ConvBlockOptions(kConvIn, kConvMid, kConvOut));
    randomise_parameters(*block, 93, 0.5);
    block->eval();
    auto parallel_block = tensor_parallel::ParallelConvBlockImpl::from_dense(block, mesh.tp_group);
    parallel_block->eval();
    const at::Tensor images = conv_input();
    EXPECT_TRUE(close(parallel_block(images), block(images))) << "conv block output, " << where;
  });
}

}  // namespace
}  // namespace torch_mp
