// The tensor-parallel layers and blocks (channel-parallel Conv2d, vocabulary-parallel embedding
// and cross-entropy, the transformer layer, the convolutional block) against the dense LibTorch
// modules computed in the same thread without any parallelism.

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/transformerlayer.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/tensor_parallel/blocks.h"
#include "torch_mp/tensor_parallel/conv.h"
#include "torch_mp/tensor_parallel/cross_entropy.h"
#include "torch_mp/tensor_parallel/embedding.h"

namespace torch_mp {
namespace {

using tensor_parallel::ColumnParallelConv2d;
using tensor_parallel::ColumnParallelConv2dImpl;
using tensor_parallel::ColumnParallelConv2dOptions;
using tensor_parallel::ParallelConvBlockImpl;
using tensor_parallel::ParallelTransformerLayerImpl;
using tensor_parallel::RowParallelConv2d;
using tensor_parallel::RowParallelConv2dImpl;
using tensor_parallel::RowParallelConv2dOptions;
using tensor_parallel::VocabParallelEmbeddingImpl;
using tensor_parallel::VocabRange;
using testing::error_of;
using testing::mentions;
using testing::seeded_generator;

// ---- shared helpers ---------------------------------------------------------------------------

/// fp32 results of a few hundred products summed in another order (all-reduced partial sums,
/// another attention kernel) differ by ~1e-6 where the values are ~1-10, hence atol 1e-5.
::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected) {
  return testing::all_close(actual, expected, /*rtol=*/1e-5, /*atol=*/1e-5);
}

/// Success if every element of `tensor` is exactly zero (also when it is empty).
::testing::AssertionResult all_zero(const at::Tensor& tensor) {
  if (at::equal(tensor, at::zeros_like(tensor))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "max |value| = " << tensor.abs().max().item<double>();
}

/// This rank's chunk of `full` along `dim`: what a tensor-parallel shard of it holds.
at::Tensor chunk_of(const at::Tensor& full, int64_t dim, const Mesh& mesh) {
  return full.chunk(mesh.tp_size(), dim)[mesh.tp_rank()];
}

/// Overwrites every parameter of `module` with uniform(-bound, bound) values drawn from `seed`
/// alone (never the shared global generator), so that every thread builds the same module.
void randomise_parameters(torch::nn::Module& module, uint64_t seed, double bound) {
  at::NoGradGuard no_grad;
  auto generator = seeded_generator(seed);
  for (auto& parameter : module.parameters()) {
    parameter.uniform_(-bound, bound, generator);
  }
}

/// Runs `body` on `world` ranks whose tensor group spans the whole world.
void on_every_rank(int world, const testing::MeshBody& body) {
  testing::run_on_mesh(world, testing::test_options(world), body);
}

/// Runs `body` on `world` ranks and checks that every rank raised an error mentioning `needle`.
void expect_every_rank_raises(int world, const testing::MeshBody& body, const std::string& needle) {
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

// ---- ColumnParallelConv2d -> RowParallelConv2d ------------------------------------------------

constexpr int64_t kConvIn = 3;
constexpr int64_t kConvMid = 8;
constexpr int64_t kConvOut = 5;

/// One kernel size and the stride, padding, dilation and padding mode set on top of it.
struct ConvGeometry {
  const char* name;
  torch::ExpandingArray<2> kernel;
  void (*apply)(torch::nn::Conv2dOptions& options);
};

// Kernels stay square where padding is "same" with a non-zero padding mode: LibTorch's Conv2d
// does not reverse the per-dim "same" amounts it hands to pad (torch.nn.Conv2d does).
const std::vector<ConvGeometry>& conv_geometries() {
  static const std::vector<ConvGeometry> geometries{
      {"stride 1, padding 1", {3, 3}, [](torch::nn::Conv2dOptions& o) { o.stride(1).padding(1); }},
      {"stride 2, padding 0, dilation 2, kernel 3x2",
       {3, 2},
       [](torch::nn::Conv2dOptions& o) { o.stride(2).padding(0).dilation(2); }},
      {"padding same (1 left, 2 right), reflect",
       {4, 4},
       [](torch::nn::Conv2dOptions& o) { o.padding(torch::kSame).padding_mode(torch::kReflect); }},
      {"padding 1, circular",
       {3, 3},
       [](torch::nn::Conv2dOptions& o) { o.padding(1).padding_mode(torch::kCircular); }},
  };
  return geometries;
}

torch::nn::Conv2dOptions conv_options(int64_t in, int64_t out, const ConvGeometry& geometry) {
  auto options = torch::nn::Conv2dOptions(in, out, geometry.kernel);
  geometry.apply(options);
  return options;
}

/// A dense Conv2d with parameters drawn from `seed`, bounded as torch::nn::Conv2d's bias is.
torch::nn::Conv2d seeded_conv(const torch::nn::Conv2dOptions& options, uint64_t seed) {
  torch::nn::Conv2d conv(options);
  const auto& k = *options.kernel_size();
  randomise_parameters(
      *conv, seed, 1.0 / std::sqrt(static_cast<double>(options.in_channels() * k[0] * k[1])));
  return conv;
}

/// Input shared by all ranks: big enough for two strided, dilated convolutions in a row.
at::Tensor conv_input() { return at::randn({2, kConvIn, 20, 11}, seeded_generator(31)); }

/// The two layers sharded from `first` and `second` on this rank's tensor group, the geometry set
/// on their options as a user would (from_dense takes it from the dense layers anyway).
struct ParallelConvPair {
  ColumnParallelConv2d column;
  RowParallelConv2d row;

  ParallelConvPair(const torch::nn::Conv2d& first,
                   const torch::nn::Conv2d& second,
                   const ConvGeometry& geometry,
                   bool gather_output,
                   const Mesh& mesh)
      : column(nullptr), row(nullptr) {
    auto column_options = ColumnParallelConv2dOptions(kConvIn, kConvMid, geometry.kernel)
                              .gather_output(gather_output)
                              .group(mesh.tp_group);
    geometry.apply(column_options.conv());
    auto row_options = RowParallelConv2dOptions(kConvMid, kConvOut, geometry.kernel)
                           .input_is_parallel(!gather_output)
                           .group(mesh.tp_group);
    geometry.apply(row_options.conv());
    column = ColumnParallelConv2d(ColumnParallelConv2dImpl::from_dense(first, column_options));
    row = RowParallelConv2d(RowParallelConv2dImpl::from_dense(second, row_options));
  }
};

/// Column -> GELU -> Row against the dense pair: output, input gradient and every parameter
/// gradient (column: dim 0 of weight and bias; row: dim 1 of the weight, the whole bias).
void check_conv_pair_matches_dense(const Mesh& mesh,
                                   const ConvGeometry& geometry,
                                   bool gather_output) {
  auto first = seeded_conv(conv_options(kConvIn, kConvMid, geometry), 32);
  auto second = seeded_conv(conv_options(kConvMid, kConvOut, geometry), 33);
  const at::Tensor input = conv_input();
  const at::Tensor dense_x = input.clone().requires_grad_(true);
  const at::Tensor dense_y = second(at::gelu(first(dense_x)));
  const at::Tensor upstream = at::randn(dense_y.sizes(), seeded_generator(34));
  dense_y.backward(upstream);

  ParallelConvPair parallel(first, second, geometry, gather_output, mesh);
  const at::Tensor x = input.clone().requires_grad_(true);
  const at::Tensor y = parallel.row(at::gelu(parallel.column(x)));
  y.backward(upstream);

  const std::string where = std::string(geometry.name) + (gather_output ? ", gathered" : "") +
                            ", rank " + std::to_string(mesh.rank);
  EXPECT_TRUE(close(y, dense_y)) << "output, " << where;
  EXPECT_TRUE(close(x.grad(), dense_x.grad())) << "input grad, " << where;
  EXPECT_TRUE(close(parallel.column->weight.grad(), chunk_of(first->weight.grad(), 0, mesh)))
      << "column weight grad, " << where;
  EXPECT_TRUE(close(parallel.column->bias.grad(), chunk_of(first->bias.grad(), 0, mesh)))
      << "column bias grad, " << where;
  EXPECT_TRUE(close(parallel.row->weight.grad(), chunk_of(second->weight.grad(), 1, mesh)))
      << "row weight grad, " << where;
  EXPECT_TRUE(close(parallel.row->bias.grad(), second->bias.grad())) << "row bias grad, " << where;
}

TEST_P(TensorParallel, ColumnGeluRowConv2dMatchesDenseOverStridePaddingDilationAndModes) {
  on_every_rank(world(), [](const Mesh& mesh) {
    for (const auto& geometry : conv_geometries()) {
      check_conv_pair_matches_dense(mesh, geometry, /*gather_output=*/false);
      check_conv_pair_matches_dense(mesh, geometry, /*gather_output=*/true);
    }
  });
}

TEST_P(TensorParallel, Conv2dToDenseGivesBackTheShardedDenseLayers) {
  on_every_rank(world(), [](const Mesh& mesh) {
    for (const auto& geometry : conv_geometries()) {
      auto first = seeded_conv(conv_options(kConvIn, kConvMid, geometry), 35);
      auto second = seeded_conv(conv_options(kConvMid, kConvOut, geometry), 36);
      ParallelConvPair parallel(first, second, geometry, /*gather_output=*/false, mesh);
      torch::nn::Conv2d column_dense = parallel.column->to_dense();
      torch::nn::Conv2d row_dense = parallel.row->to_dense();
      const std::string where = std::string(geometry.name) + ", rank " + std::to_string(mesh.rank);
      EXPECT_TRUE(at::equal(column_dense->weight, first->weight)) << where;
      EXPECT_TRUE(at::equal(column_dense->bias, first->bias)) << where;
      EXPECT_TRUE(at::equal(row_dense->weight, second->weight)) << where;
      EXPECT_TRUE(at::equal(row_dense->bias, second->bias)) << where;
      // The geometry comes back too: the round-tripped layers compute what the originals do.
      at::NoGradGuard no_grad;
      const at::Tensor hidden = first(conv_input());
      EXPECT_TRUE(close(column_dense(conv_input()), hidden)) << "column output, " << where;
      EXPECT_TRUE(close(row_dense(hidden), second(hidden))) << "row output, " << where;
    }
  });
}

TEST_P(TensorParallelOnSeveralRanks, ColumnConv2dRaisesWhenOutChannelsIsNotDivisible) {
  const int64_t out_channels = 3 * world() + 1;
  expect_every_rank_raises(
      world(),
      [&](const Mesh& mesh) {
        ColumnParallelConv2d(
            ColumnParallelConv2dOptions(kConvIn, out_channels, 3).group(mesh.tp_group));
      },
      "out_channels (" + std::to_string(out_channels) + ") must be divisible");
}

TEST_P(TensorParallelOnSeveralRanks, RowConv2dRaisesWhenInChannelsIsNotDivisible) {
  const int64_t in_channels = 3 * world() + 1;
  expect_every_rank_raises(
      world(),
      [&](const Mesh& mesh) {
        RowParallelConv2d(RowParallelConv2dOptions(in_channels, kConvOut, 3).group(mesh.tp_group));
      },
      "in_channels (" + std::to_string(in_channels) + ") must be divisible");
}

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
