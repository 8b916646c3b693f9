// ColumnParallelConv2d and RowParallelConv2d against the dense LibTorch modules computed in the
// same thread without any parallelism.

#include "torch_mp/tensor_parallel/conv.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/conv.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::ColumnParallelConv2d;
using tensor_parallel::ColumnParallelConv2dImpl;
using tensor_parallel::ColumnParallelConv2dOptions;
using tensor_parallel::RowParallelConv2d;
using tensor_parallel::RowParallelConv2dImpl;
using tensor_parallel::RowParallelConv2dOptions;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

// ---- ColumnParallelConv2d -> RowParallelConv2d ------------------------------------------------

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
                              .conv(conv_options(kConvIn, kConvMid, geometry))
                              .gather_output(gather_output)
                              .group(mesh.tp_group);
    auto row_options = RowParallelConv2dOptions(kConvMid, kConvOut, geometry.kernel)
                           .conv(conv_options(kConvMid, kConvOut, geometry))
                           .input_is_parallel(!gather_output)
                           .group(mesh.tp_group);
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

}  // namespace
}  // namespace torch_mp
