#pragma once
// What the tensor-parallel layer tests share (linear_test, conv_test, embedding_test,
// cross_entropy_test, attention_test, mlp_test, transformer_layer_test, conv_block_test):
// tolerances, helpers, and the fixtures parameterised by the world size (the tensor group spans
// the whole world), instantiated once in tensor_parallel_fixture.cpp.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>

#include <cmath>
#include <string>

#include "tensor_checks.h"
#include "thread_world.h"

namespace torch_mp::tp_testing {

using testing::seeded_generator;

/// fp32 results of a few hundred products summed in another order (all-reduced partial sums,
/// another attention kernel) differ by ~1e-6 where the values are ~1-10, hence atol 1e-5.
inline ::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected) {
  return testing::all_close(actual, expected, /*rtol=*/1e-5, /*atol=*/1e-5);
}

/// Success if every element of `tensor` is exactly zero (also when it is empty).
inline ::testing::AssertionResult all_zero(const at::Tensor& tensor) {
  if (at::equal(tensor, at::zeros_like(tensor))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "max |value| = " << tensor.abs().max().item<double>();
}

/// This rank's chunk of `full` along `dim`: what a tensor-parallel shard of it holds.
inline at::Tensor chunk_of(const at::Tensor& full, int64_t dim, const Mesh& mesh) {
  return full.chunk(mesh.tp_size(), dim)[mesh.tp_rank()];
}

/// Overwrites every parameter of `module` with uniform(-bound, bound) values drawn from `seed`
/// alone (never the shared global generator), so that every thread builds the same module.
inline void randomise_parameters(torch::nn::Module& module, uint64_t seed, double bound) {
  at::NoGradGuard no_grad;
  auto generator = seeded_generator(seed);
  for (auto& parameter : module.parameters()) {
    parameter.uniform_(-bound, bound, generator);
  }
}

/// Runs `body` on `world` ranks whose tensor group spans the whole world.
inline void on_every_rank(int world, const testing::MeshBody& body) {
  testing::run_on_mesh(world, testing::test_options(world), body);
}

/// Runs `body` on `world` ranks and checks that every rank raised an error mentioning `needle`.
inline void expect_every_rank_raises(int world,
                                     const testing::MeshBody& body,
                                     const std::string& needle) {
  testing::expect_every_rank_raised(
      testing::run_on_mesh_collecting_errors(
          world, [&](int) { return testing::test_options(world); }, body),
      needle);
}

/// Parameterised by the world size; the tensor group spans the whole world.
class TensorParallel : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
};

/// Errors need more than one rank: every size is divisible by one.
class TensorParallelOnSeveralRanks : public TensorParallel {};

/// Channels of the convolution tests (conv_test, conv_block_test).
constexpr int64_t kConvIn = 3;
constexpr int64_t kConvMid = 8;
constexpr int64_t kConvOut = 5;

/// A dense Conv2d with parameters drawn from `seed`, bounded as torch::nn::Conv2d's bias is.
inline torch::nn::Conv2d seeded_conv(const torch::nn::Conv2dOptions& options, uint64_t seed) {
  torch::nn::Conv2d conv(options);
  const auto& k = *options.kernel_size();
  randomise_parameters(
      *conv, seed, 1.0 / std::sqrt(static_cast<double>(options.in_channels() * k[0] * k[1])));
  return conv;
}

/// Input shared by all ranks: big enough for two strided, dilated convolutions in a row.
inline at::Tensor conv_input() { return at::randn({2, kConvIn, 20, 11}, seeded_generator(31)); }

}  // namespace torch_mp::tp_testing
