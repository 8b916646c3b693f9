// ParallelSelfAttention against torch::nn::MultiheadAttention computed in the same thread without
// any parallelism.

#include "torch_mp/tensor_parallel/attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>

#include <string>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

TEST_P(TensorParallel, SelfAttentionShardsMultiheadAttentionAndGathersItBack) {
  on_every_rank(world(), [](const Mesh& mesh) {
    const std::string where = "rank " + std::to_string(mesh.rank);
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

}  // namespace
}  // namespace torch_mp
