// Context parallelism (context_parallel/): the sequence cut shard_sequence makes and
// unshard_sequence undoes, and attention over the parts by each method, causal or not,
// balanced or not, equal to scaled_dot_product_attention on the whole sequence (outputs and
// q/k/v gradients), at cp = 2 and 4; the transformer layer with context_parallel equal to the
// dense layer on the whole sequence (also at tp 2 x cp 2 with sequence parallelism), and the
// cross-entropy's mean over the context group. The Python tests cover masks, grouped-query
// attention and more layouts; these hold the C++ entry points to the same results.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <tuple>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"
#include "torch_mp/comm.h"
#include "torch_mp/context_parallel/attention.h"
#include "torch_mp/context_parallel/sharding.h"
#include "torch_mp/tensor_parallel/cross_entropy.h"
#include "torch_mp/tensor_parallel/transformer_layer.h"

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
  testing::expect_every_rank_raised(errors, "then q's, k's and v's dims and sizes");
}

// (tp, cp, method, sequence parallel)
using LayerCase = std::tuple<int, int, std::string, bool>;

class ContextParallelLayer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(ContextParallelLayer, EqualsTheDenseLayerOnTheWholeSequence) {
  const auto& [tp, cp, method, sequence_parallel] = GetParam();
  const int64_t length = 16, batch = 2, hidden = 16;
  testing::run_on_mesh(tp * cp, testing::test_options(tp).cp(cp), [&](const Mesh& mesh) {
    dense::TransformerLayer dense(dense::TransformerLayerOptions(hidden, 4, 32)
                                      .dropout(0.0)
                                      .activation("gelu")
                                      .norm_first(true)
                                      .bias(false));
    tp_testing::randomise_parameters(*dense, 74, 0.5);
    const auto input = at::randn({length, batch, hidden}, seeded_generator(72));
    const auto upstream = at::randn({length, batch, hidden}, seeded_generator(73));
    const auto dense_x = input.clone().requires_grad_(true);
    const auto causal = at::full({length, length}, -std::numeric_limits<float>::infinity()).triu(1);
    dense->forward(dense_x, causal).backward(upstream);

    auto layer = tensor_parallel::ParallelTransformerLayerImpl::from_dense(
        dense,
        tensor_parallel::ParallelTransformerLayerOptions(hidden, 4, 32)
            .sequence_parallel(sequence_parallel)
            .group(mesh.tp_group)
            .context_parallel(true)
            .context_group(mesh.cp_group)
            .context_method(method));
    const auto mine = [&](const at::Tensor& whole) {  // this rank's part, then its chunk
      const auto part = shard_sequence(whole, 0, mesh.cp_group);
      return sequence_parallel ? tp_testing::chunk_of(part, 0, mesh) : part;
    };
    const auto x = mine(input).clone().requires_grad_(true);
    const auto y = layer->forward(x, {}, /*is_causal=*/true);
    y.backward(mine(upstream));
    const auto expected = dense->forward(input, causal);
    EXPECT_TRUE(testing::all_close(y, mine(expected.detach()), 1e-5, 1e-5)) << "output";
    EXPECT_TRUE(testing::all_close(x.grad(), mine(dense_x.grad()), 1e-5, 1e-5)) << "input grad";
    // Parameters replicated over the context group: the parts' gradients sum to the dense one.
    const auto summed = [&](const at::Tensor& grad) {
      return comm::all_reduce(grad.clone(), mesh.cp_group);
    };
    EXPECT_TRUE(testing::all_close(
        summed(layer->norm1->weight.grad()), dense->norm1->weight.grad(), 1e-5, 1e-5))
        << "norm1 weight grad";
    EXPECT_TRUE(testing::all_close(summed(layer->mlp->fc1->weight.grad()),
                                   tp_testing::chunk_of(dense->linear1->weight.grad(), 0, mesh),
                                   1e-5,
                                   1e-5))
        << "fc1 weight grad";
    const auto qkv_grad = dense->self_attn->in_proj_weight.grad().view({3, hidden, hidden});
    EXPECT_TRUE(testing::all_close(summed(layer->self_attn->qkv->weight.grad()),
                                   tp_testing::chunk_of(qkv_grad, 1, mesh).reshape({-1, hidden}),
                                   1e-5,
                                   1e-5))
        << "qkv weight grad";
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts,
                         ContextParallelLayer,
                         ::testing::Values(LayerCase{1, 2, "ring", false},
                                           LayerCase{1, 2, "all_gather", false},
                                           LayerCase{1, 2, "all_to_all", false},
                                           LayerCase{2, 2, "ring", true}),
                         [](const ::testing::TestParamInfo<LayerCase>& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) + "_cp" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  std::get<2>(info.param) + (std::get<3>(info.param) ? "_sp" : "");
                         });

TEST(ContextParallelLayer, DropoutInTrainingIsRefusedOnEveryRank) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1).cp(2); },
      [](const Mesh& mesh) {
        tensor_parallel::ParallelTransformerLayer layer(
            tensor_parallel::ParallelTransformerLayerOptions(16, 4, 32)
                .group(mesh.tp_group)
                .context_parallel(true)
                .context_group(mesh.cp_group));
        layer->forward(at::randn({8, 2, 16}), {}, true);
      });
  testing::expect_every_rank_raised(errors,
                                    "under context parallelism is not supported in training");
}

TEST(ContextParallelCrossEntropy, IsTheMeanOverTheWholeSequence) {
  testing::run_on_mesh(2, testing::test_options(1).cp(2), [](const Mesh& mesh) {
    const auto logits = at::randn({16, 2, 12}, seeded_generator(4));
    auto target = at::randint(12, {16, 2}, seeded_generator(6), at::kLong);
    target.slice(0, 0, 4).fill_(-100);  // more ignored targets on one part than the other
    const auto whole = logits.clone().requires_grad_(true);
    const auto expected = at::cross_entropy_loss(whole.flatten(0, 1), target.flatten());
    expected.backward();
    const auto part = shard_sequence(logits, 0, mesh.cp_group).requires_grad_(true);
    const auto loss =
        tensor_parallel::vocab_parallel_cross_entropy(part,
                                                      shard_sequence(target, 0, mesh.cp_group),
                                                      mesh.tp_group,
                                                      -100,
                                                      0.0,
                                                      at::Reduction::Mean,
                                                      std::nullopt,
                                                      mesh.cp_group);
    loss.backward();
    EXPECT_TRUE(testing::all_close(loss, expected.detach(), 1e-5, 1e-6)) << "loss";
    // The adjoint of the sum over the context ranks: cp times one process's gradient.
    EXPECT_TRUE(testing::all_close(
        part.grad(), 2 * shard_sequence(whole.grad(), 0, mesh.cp_group), 1e-5, 1e-6))
        << "logits grad";
  });
}

}  // namespace
}  // namespace torch_mp::context_parallel
