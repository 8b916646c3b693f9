// Context parallelism (context_parallel/): the sequence cut shard_sequence makes and
// unshard_sequence undoes, and attention over the parts by each method, causal or not,
// balanced or not, equal to scaled_dot_product_attention on the whole sequence (outputs and
// q/k/v gradients), at cp = 2 and 4. The Python tests cover masks, grouped-query attention and
// tp x cp; these hold the C++ entry points to the same results.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/context_parallel/attention.h"
#include "torch_mp/context_parallel/sharding.h"

namespace torch_mp::context_parallel {
namespace {

using testing::seeded_generator;

TEST(SequencePositions, BalancedRanksHoldChunksRAndTheirMirror) {
  EXPECT_TRUE(sequence_positions(8, 0, 2).equal(at::tensor({0, 1, 6, 7}, at::kLong)));
  EXPECT_TRUE(sequence_positions(8, 1, 2).equal(at::tensor({2, 3, 4, 5}, at::kLong)));
  EXPECT_TRUE(sequence_positions(8, 1, 2, false).equal(at::tensor({4, 5, 6, 7}, at::kLong)));
  EXPECT_TRUE(gathered_positions(8, 2).equal(at::tensor({0, 1, 6, 7, 2, 3, 4, 5}, at::kLong)));
  EXPECT_TRUE(testing::mentions(testing::error_of([] { sequence_positions(6, 0, 2); }),
                                "must be divisible by 2 * the context-parallel size (4 chunks"));
}

// (world, method, causal, balanced)
using AttentionCase = std::tuple<int, std::string, bool, bool>;

class ContextAttention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(ContextAttention, EqualsAttentionOnTheWholeSequence) {
  const auto& [world, method, causal, balanced] = GetParam();
  const int64_t batch = 2, heads = 4, length = 16, dim = 8;
  testing::run_on_mesh(world, testing::test_options(1).cp(world), [&](const Mesh& mesh) {
    const auto whole = [&](uint64_t seed) {
      return at::randn({batch, heads, length, dim}, seeded_generator(seed));
    };
    auto q = whole(1).requires_grad_(), k = whole(2).requires_grad_(),
         v = whole(3).requires_grad_();
    const auto grad = whole(4);
    const auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
    expected.backward(grad);
    const auto part = [&](const at::Tensor& t) {
      return shard_sequence(t.detach(), 2, mesh.cp_group, balanced);
    };
    auto q_part = part(q).requires_grad_(), k_part = part(k).requires_grad_(),
         v_part = part(v).requires_grad_();
    const auto out =
        attention(q_part,
                  k_part,
                  v_part,
                  mesh.cp_group,
                  AttentionOptions().is_causal(causal).method(method).load_balance(balanced));
    out.backward(part(grad));
    EXPECT_TRUE(testing::all_close(out, part(expected), 1e-5, 1e-5)) << "output";
    EXPECT_TRUE(testing::all_close(q_part.grad(), part(q.grad()), 1e-5, 1e-5)) << "dq";
    EXPECT_TRUE(testing::all_close(k_part.grad(), part(k.grad()), 1e-5, 1e-5)) << "dk";
    EXPECT_TRUE(testing::all_close(v_part.grad(), part(v.grad()), 1e-5, 1e-5)) << "dv";
    // The whole output back from the parts.
    EXPECT_TRUE(testing::all_close(
        unshard_sequence(out.detach(), 2, mesh.cp_group, balanced), expected.detach(), 1e-5, 1e-5));
  });
}

INSTANTIATE_TEST_SUITE_P(Methods,
                         ContextAttention,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values("ring", "all_gather", "all_to_all"),
                                            ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<AttentionCase>& info) {
                           return "cp" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param) +
                                  (std::get<2>(info.param) ? "_causal" : "_full") +
                                  (std::get<3>(info.param) ? "_balanced" : "_plain");
                         });

TEST(ContextAttention, RanksWithDifferentPartsRaiseOnEveryRank) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1).cp(2); },
      [](const Mesh& mesh) {
        const auto q = at::randn({1, 2, 4 + 2 * mesh.cp_rank(), 4});
        attention(q, q, q, mesh.cp_group, AttentionOptions().is_causal(true));
      });
  testing::expect_every_rank_raised(errors, "[batch, heads, key/value heads, sequence part");
}

}  // namespace
}  // namespace torch_mp::context_parallel
