// vocab_parallel_cross_entropy against the dense LibTorch modules computed in the same thread
// without any parallelism.

#include "torch_mp/tensor_parallel/cross_entropy.h"
#include "torch_mp/tensor_parallel/embedding.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::VocabRange;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

// ---- vocab_parallel_cross_entropy -------------------------------------------------------------

constexpr int64_t kIgnoreIndex = -100;

/// Targets [5, 3]: the last id (on the last rank) and three ignored entries among random ids.
at::Tensor cross_entropy_targets(int64_t vocab) {
  const at::Tensor target = at::randint(vocab, at::IntArrayRef{5, 3}, seeded_generator(62));
  const at::Tensor flat = target.view({-1});
  flat[0].fill_(vocab - 1);
  for (const int64_t i : {2, 7, 13}) {
    flat[i].fill_(kIgnoreIndex);
  }
  return target;
}

torch::nn::functional::CrossEntropyFuncOptions::reduction_t dense_reduction(
    at::Reduction::Reduction reduction) {
  switch (reduction) {
    case at::Reduction::None:
      return torch::kNone;
    case at::Reduction::Sum:
      return torch::kSum;
    default:
      return torch::kMean;
  }
}

const char* reduction_name(at::Reduction::Reduction reduction) {
  return reduction == at::Reduction::None  ? "none"
         : reduction == at::Reduction::Sum ? "sum"
                                           : "mean";
}

/// vocab_parallel_cross_entropy against cross_entropy on the dense logits [5, 3, V] flattened to
/// [15, V]. Unpadded, a rank's shard is its chunk of the last dim; padded, it is its rows
/// [start, start + real) of the vocabulary zero-padded to `rows` columns, and V is passed.
void check_cross_entropy_matches_dense(const Mesh& mesh,
                                       int64_t vocab,
                                       bool padded,
                                       double smoothing,
                                       at::Reduction::Reduction reduction) {
  const at::Tensor logits = at::randn({5, 3, vocab}, seeded_generator(61));
  const at::Tensor target = cross_entropy_targets(vocab);
  const at::Tensor dense_logits = logits.clone().requires_grad_(true);
  const at::Tensor dense_loss =
      torch::nn::functional::cross_entropy(dense_logits.reshape({-1, vocab}),
                                           target.reshape({-1}),
                                           torch::nn::functional::CrossEntropyFuncOptions()
                                               .ignore_index(kIgnoreIndex)
                                               .label_smoothing(smoothing)
                                               .reduction(dense_reduction(reduction)));
  const bool none = reduction == at::Reduction::None;
  const at::Tensor upstream =
      none ? at::randn(target.sizes(), seeded_generator(63)) : at::ones_like(dense_loss);
  dense_loss.backward(upstream.reshape(dense_loss.sizes()));

  const VocabRange range = tensor_parallel::vocab_range(vocab, mesh.tp_group);
  at::Tensor local;
  if (padded) {
    // Padding filled with huge logits: they must get neither probability nor gradient.
    local = at::full({5, 3, range.rows}, 1e4, logits.options());
    local.narrow(-1, 0, range.real).copy_(logits.narrow(-1, range.start, range.real));
  } else {
    local = chunk_of(logits, -1, mesh).clone();
  }
  local.requires_grad_(true);
  const at::Tensor loss = tensor_parallel::vocab_parallel_cross_entropy(
      local,
      target,
      mesh.tp_group,
      kIgnoreIndex,
      smoothing,
      reduction,
      padded ? std::optional<int64_t>(vocab) : std::nullopt);
  loss.backward(upstream);

  const std::string where = "vocab " + std::to_string(vocab) + ", smoothing " +
                            std::to_string(smoothing) + ", reduction " + reduction_name(reduction) +
                            ", rank " + std::to_string(mesh.rank);
  EXPECT_TRUE(close(loss, none ? dense_loss.view(target.sizes()) : dense_loss))
      << "loss, " << where;
  EXPECT_TRUE(close(local.grad().narrow(-1, 0, range.real),
                    dense_logits.grad().narrow(-1, range.start, range.real)))
      << "logits grad, " << where;
  EXPECT_TRUE(all_zero(local.grad().narrow(-1, range.real, range.rows - range.real)))
      << "padded columns' grad, " << where;
}

void check_cross_entropy_cases(const Mesh& mesh, int64_t vocab, bool padded) {
  for (const double smoothing : {0.0, 0.1}) {
    for (const auto reduction : {at::Reduction::Mean, at::Reduction::Sum, at::Reduction::None}) {
      check_cross_entropy_matches_dense(mesh, vocab, padded, smoothing, reduction);
    }
  }
}

TEST_P(TensorParallel, VocabCrossEntropyMatchesDenseOverSmoothingAndReductions) {
  on_every_rank(world(),
                [](const Mesh& mesh) { check_cross_entropy_cases(mesh, 16, /*padded=*/false); });
}

TEST_P(TensorParallel, PaddedVocabCrossEntropyMatchesDenseAndLeavesPaddingWithoutGradient) {
  on_every_rank(world(),
                [](const Mesh& mesh) { check_cross_entropy_cases(mesh, 13, /*padded=*/true); });
}

}  // namespace
}  // namespace torch_mp
