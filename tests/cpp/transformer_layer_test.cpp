// ParallelTransformerLayer against the dense layers it shards (LibTorch's, and
// torch_mp::dense::TransformerLayer pre-LN without biases), computed in the same thread without
// any parallelism.

#include "torch_mp/tensor_parallel/transformer_layer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/transformerlayer.h>

#include <limits>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"
#include "torch_mp/random.h"
#include "torch_mp/split_backward.h"

namespace torch_mp {
namespace {

using tensor_parallel::ParallelTransformerLayerImpl;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

constexpr int64_t kSeq = 8;
constexpr int64_t kModel = 16;

torch::nn::TransformerEncoderLayer seeded_transformer_layer() {
  torch::nn::TransformerEncoderLayer dense(
      torch::nn::TransformerEncoderLayerOptions(kModel, 4).dim_feedforward(32).dropout(0.0));
  randomise_parameters(*dense, 71, 0.5);
  return dense;
}

/// Pre-LN, no biases, gelu: the layers of torch_mp.models.DenseGPT.
dense::TransformerLayer seeded_pre_ln_layer() {
  dense::TransformerLayer layer(dense::TransformerLayerOptions(kModel, 4, 32)
                                    .dropout(0.0)
                                    .activation("gelu")
                                    .norm_first(true)
                                    .bias(false));
  randomise_parameters(*layer, 74, 0.5);
  return layer;
}

/// The layer sharded from a dense one against it. Under sequence parallelism rank r feeds rows
/// [r * s / t, (r + 1) * s / t) of x and gets the same rows of the output and input gradient.
template <typename DenseLayer>
void check_transformer_layer_matches_dense(const Mesh& mesh,
                                           DenseLayer dense,
                                           bool sequence_parallel,
                                           const at::Tensor& mask = {}) {
  const at::Tensor input = at::randn({kSeq, 2, kModel}, seeded_generator(72));
  const at::Tensor upstream = at::randn({kSeq, 2, kModel}, seeded_generator(73));
  const at::Tensor dense_x = input.clone().requires_grad_(true);
  const at::Tensor dense_y = dense->forward(dense_x, mask);
  dense_y.backward(upstream);

  auto layer = ParallelTransformerLayerImpl::from_dense(dense, mesh.tp_group, sequence_parallel);
  const auto rows = [&](const at::Tensor& full) {
    return sequence_parallel ? chunk_of(full, 0, mesh) : full;
  };
  const at::Tensor x = rows(input).clone().requires_grad_(true);
  const at::Tensor y = layer(x, mask);
  y.backward(rows(upstream));

  const std::string where = std::string(sequence_parallel ? "sequence parallel" : "replicated") +
                            ", rank " + std::to_string(mesh.rank);
  EXPECT_TRUE(close(y, rows(dense_y))) << "output, " << where;
  EXPECT_TRUE(close(x.grad(), rows(dense_x.grad()))) << "input grad, " << where;
  // Replicated parameters: the whole dense gradient on every rank.
  EXPECT_TRUE(close(layer->norm1->weight.grad(), dense->norm1->weight.grad()))
      << "norm1 weight grad, " << where;
  EXPECT_TRUE(close(layer->norm2->weight.grad(), dense->norm2->weight.grad()))
      << "norm2 weight grad, " << where;
  ASSERT_EQ(layer->norm1->bias.defined(), dense->norm1->bias.defined()) << where;
  ASSERT_EQ(layer->self_attn->proj->bias.defined(), dense->self_attn->out_proj->bias.defined());
  if (dense->norm1->bias.defined()) {
    EXPECT_TRUE(close(layer->norm1->bias.grad(), dense->norm1->bias.grad()))
        << "norm1 bias grad, " << where;
    EXPECT_TRUE(close(layer->self_attn->proj->bias.grad(), dense->self_attn->out_proj->bias.grad()))
        << "attention output bias grad, " << where;
  }
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
    check_transformer_layer_matches_dense(
        mesh, seeded_transformer_layer(), /*sequence_parallel=*/false);
  });
}

TEST_P(TensorParallel, PreLayerNormLayerWithoutBiasesFromDenseMatchesItUnderACausalMask) {
  on_every_rank(world(), [](const Mesh& mesh) {
    const auto causal = at::full({kSeq, kSeq}, -std::numeric_limits<float>::infinity()).triu(1);
    for (const bool sequence_parallel : {false, true}) {
      check_transformer_layer_matches_dense(mesh, seeded_pre_ln_layer(), sequence_parallel, causal);
    }
  });
}

TEST_P(TensorParallel, LoadingALayerWithBiasesIntoOneWithoutIsRefused) {
  expect_every_rank_raises(
      world(),
      [](const Mesh& mesh) {
        auto layer = ParallelTransformerLayerImpl::from_dense(seeded_pre_ln_layer(), mesh.tp_group);
        layer->load_dense(seeded_transformer_layer());
      },
      "LayerNorms have no bias");
}

TEST_P(TensorParallel, SequenceParallelTransformerLayerMatchesTheDenseRowsItHolds) {
  on_every_rank(world(), [](const Mesh& mesh) {
    check_transformer_layer_matches_dense(
        mesh, seeded_transformer_layer(), /*sequence_parallel=*/true);
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

// ---- recomputation ----------------------------------------------------------------------------

struct RecomputeCase {
  std::string recompute;  // "", "full" or "selective"
  bool split = false;     // the zero-bubble split: B, then W
  double dropout = 0.0;
  bool sequence_parallel = false;
};

// One forward and backward of a pre-LN layer (causal) drawn from fixed seeds: the output, the
// input gradient and every parameter's gradient.
std::vector<at::Tensor> layer_step(const Mesh& mesh, const RecomputeCase& c) {
  at::manual_seed(5);
  torch_mp::rng_tracker().reset();
  torch_mp::rng_tracker().add(torch_mp::kModelParallelRng, 11);
  auto dense = seeded_pre_ln_layer();
  dense->options.dropout(c.dropout);
  auto layer = ParallelTransformerLayerImpl::from_dense(
      dense, mesh.tp_group, c.sequence_parallel, c.recompute);
  auto rows = [&](const at::Tensor& full) {
    return c.sequence_parallel ? chunk_of(full, 0, mesh) : full;
  };
  const auto x =
      rows(at::randn({kSeq, 2, kModel}, seeded_generator(72))).clone().requires_grad_(true);
  const auto upstream = rows(at::randn({kSeq, 2, kModel}, seeded_generator(73)));
  const at::Tensor y = layer->forward(x, at::Tensor(), /*is_causal=*/true);
  std::vector<at::Tensor> out{y.detach()};
  if (c.split) {
    WeightWork work;
    out.push_back(backward_input({y}, {upstream}, {x}, layer->parameters(), work)[0]);
    backward_weight(work);
  } else {
    y.backward(upstream);
    out.push_back(x.grad());
  }
  for (const auto& p : layer->parameters()) {
    out.push_back(p.grad());
  }
  torch_mp::rng_tracker().reset();
  return out;
}

void expect_same_steps(const Mesh& mesh, const RecomputeCase& c) {
  auto kept = c;
  kept.recompute = "";
  const auto expected = layer_step(mesh, kept);
  const auto actual = layer_step(mesh, c);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(actual[i].defined()) << i;
    EXPECT_TRUE(at::equal(actual[i], expected[i]))
        << "recompute \"" << c.recompute << "\"" << (c.split ? ", split" : "") << ", dropout "
        << c.dropout << ", tensor " << i << ", rank " << mesh.rank;
  }
}

TEST_P(TensorParallel, RecomputedLayerEqualsTheLayerThatKeepsItsActivations) {
  // Without dropout on several ranks (threads share the generators): recomputation with the
  // tensor group's collectives inside it, under a whole backward and the zero-bubble split.
  on_every_rank(world(), [](const Mesh& mesh) {
    for (const std::string recompute : {"full", "selective"}) {
      for (const bool split : {false, true}) {
        for (const bool sequence_parallel : {false, true}) {
          expect_same_steps(mesh, {recompute, split, 0.0, sequence_parallel});
        }
      }
    }
  });
}

TEST(TransformerLayerRecompute, ReplaysTheDropoutMasksOfBothStreams) {
  // One rank: dropout on whole tensors draws from the default generator, on sequence-parallel
  // rows and attention probabilities from the tracker's per-rank stream.
  on_every_rank(1, [](const Mesh& mesh) {
    for (const std::string recompute : {"full", "selective"}) {
      for (const bool split : {false, true}) {
        for (const bool sequence_parallel : {false, true}) {
          expect_same_steps(mesh, {recompute, split, 0.3, sequence_parallel});
        }
      }
    }
    // The dropout was on: the output differs from the one without it.
    EXPECT_FALSE(at::equal(layer_step(mesh, {"", false, 0.3, false})[0],
                           layer_step(mesh, {"", false, 0.0, false})[0]));
  });
}

TEST_P(TensorParallelOnSeveralRanks, TransformerLayerRefusesAnUnknownOrDisagreeingRecompute) {
  expect_every_rank_raises(
      world(),
      [](const Mesh& mesh) {
        ParallelTransformerLayerImpl::from_dense(
            seeded_pre_ln_layer(), mesh.tp_group, false, "everything");
      },
      "recompute must be");
  expect_every_rank_raises(
      world(),
      [](const Mesh& mesh) {
        ParallelTransformerLayerImpl::from_dense(
            seeded_pre_ln_layer(), mesh.tp_group, false, mesh.rank == 0 ? "full" : "");
      },
      "recompute (here ");
}

}  // namespace
}  // namespace torch_mp
