// VocabParallelEmbedding against the dense LibTorch modules computed in the same thread without any
// parallelism.

#include "torch_mp/tensor_parallel/embedding.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::VocabParallelEmbeddingImpl;
using tensor_parallel::VocabRange;
using testing::error_of;
using testing::mentions;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

// ---- VocabParallelEmbedding -------------------------------------------------------------------

constexpr int64_t kEmbeddingDim = 6;

/// A dense table drawn from a seed of its own, the padding_idx row zero as LibTorch draws it.
torch::nn::Embedding seeded_embedding(int64_t vocab, std::optional<int64_t> padding_idx) {
  torch::nn::Embedding dense(
      torch::nn::EmbeddingOptions(vocab, kEmbeddingDim).padding_idx(padding_idx));
  at::NoGradGuard no_grad;
  dense->weight.normal_(0.0, 1.0, seeded_generator(51));
  if (padding_idx) {
    dense->weight[*padding_idx].zero_();
  }
  return dense;
}

/// Ids [4, 5] that include the last id (owned by the last rank) and `padding_idx`.
at::Tensor embedding_ids(int64_t vocab, std::optional<int64_t> padding_idx) {
  const at::Tensor ids = at::randint(vocab, at::IntArrayRef{4, 5}, seeded_generator(52));
  ids.view({-1})[0].fill_(vocab - 1);
  if (padding_idx) {
    ids.view({-1})[7].fill_(*padding_idx);
    ids.view({-1})[13].fill_(*padding_idx);
  }
  return ids;
}

/// Output and weight gradient against the dense table: the shard's real rows hold rows
/// [start, start + real) of the dense gradient, its padding rows (and the padding_idx row) zero.
void check_embedding_matches_dense(const Mesh& mesh,
                                   int64_t vocab,
                                   std::optional<int64_t> padding_idx) {
  auto dense = seeded_embedding(vocab, padding_idx);
  const at::Tensor ids = embedding_ids(vocab, padding_idx);
  const at::Tensor dense_y = dense(ids);
  const at::Tensor upstream = at::randn(dense_y.sizes(), seeded_generator(53));
  dense_y.backward(upstream);

  auto layer = VocabParallelEmbeddingImpl::from_dense(dense, mesh.tp_group);
  const at::Tensor y = layer(ids);
  y.backward(upstream);
  const torch::nn::Embedding round_trip = layer->to_dense();  // collective: before any check

  const VocabRange range = tensor_parallel::vocab_range(vocab, mesh.tp_group);
  const at::Tensor grad = layer->weight.grad();
  const std::string where = "vocab " + std::to_string(vocab) +
                            (padding_idx ? ", padding_idx " + std::to_string(*padding_idx) : "") +
                            ", rank " + std::to_string(mesh.rank);
  EXPECT_TRUE(close(y, dense_y)) << "output, " << where;
  ASSERT_EQ(grad.size(0), range.rows) << where;
  EXPECT_TRUE(
      close(grad.narrow(0, 0, range.real), dense->weight.grad().narrow(0, range.start, range.real)))
      << "weight grad, " << where;
  EXPECT_TRUE(all_zero(grad.narrow(0, range.real, range.rows - range.real)))
      << "padding rows' grad, " << where;
  if (padding_idx && *padding_idx >= range.start && *padding_idx < range.start + range.real) {
    EXPECT_TRUE(all_zero(grad[*padding_idx - range.start])) << "padding_idx row grad, " << where;
  }

  EXPECT_TRUE(at::equal(round_trip->weight, dense->weight)) << "to_dense, " << where;
  EXPECT_TRUE(round_trip->options.padding_idx() == dense->options.padding_idx())
      << "to_dense padding_idx, " << where;
}

TEST_P(TensorParallel, VocabEmbeddingMatchesDenseWithAndWithoutPaddingIdx) {
  on_every_rank(world(), [](const Mesh& mesh) {
    check_embedding_matches_dense(mesh, 16, std::nullopt);
    check_embedding_matches_dense(mesh, 16, 5);
  });
}

// 13 is divisible by neither 2 nor 4: the last ranks' shards end in padding rows.
TEST_P(TensorParallel, PaddedVocabEmbeddingMatchesDenseWithAndWithoutPaddingIdx) {
  on_every_rank(world(), [](const Mesh& mesh) {
    check_embedding_matches_dense(mesh, 13, std::nullopt);
    check_embedding_matches_dense(mesh, 13, 5);
    check_embedding_matches_dense(mesh, 13, 12);  // the last rank's only real row at 4 ranks
  });
}

TEST_P(TensorParallel, VocabEmbeddingRaisesOnIdsOutOfRange) {
  on_every_rank(world(), [](const Mesh& mesh) {
    auto layer =
        VocabParallelEmbeddingImpl::from_dense(seeded_embedding(13, std::nullopt), mesh.tp_group);
    const auto too_high = error_of([&] { layer(at::arange(14)); });
    const auto negative = error_of([&] { layer(at::full({2}, -1, at::kLong)); });
    EXPECT_TRUE(mentions(too_high, "ids must be in [0, 13)")) << "rank " << mesh.rank;
    EXPECT_TRUE(mentions(negative, "ids must be in [0, 13)")) << "rank " << mesh.rank;
  });
}

}  // namespace
}  // namespace torch_mp
