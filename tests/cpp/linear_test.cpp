// ColumnParallelLinear and RowParallelLinear against a dense MLP computed in the same thread
// without any parallelism.

#include "torch_mp/tensor_parallel/linear.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

#include "tensor_checks.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::ColumnParallelLinear;
using tensor_parallel::ColumnParallelLinearImpl;
using tensor_parallel::ColumnParallelLinearOptions;
using tensor_parallel::RowParallelLinear;
using tensor_parallel::RowParallelLinearImpl;
using tensor_parallel::RowParallelLinearOptions;
using testing::all_close;
using testing::seeded_generator;

constexpr int64_t kIn = 8;
constexpr int64_t kHidden = 16;
constexpr int64_t kOut = 6;
constexpr int64_t kBatch = 5;

/// A dense Linear whose parameters come from `seed` alone (never the shared global generator),
/// so that every thread builds the same layer.
torch::nn::Linear seeded_linear(int64_t in, int64_t out, uint64_t seed) {
  torch::nn::Linear layer(in, out);
  at::NoGradGuard no_grad;
  auto generator = seeded_generator(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  layer->weight.uniform_(-bound, bound, generator);
  layer->bias.uniform_(-bound, bound, generator);
  return layer;
}

/// The reference: Linear -> GELU -> Linear on one rank, with its gradients.
struct DenseMlp {
  torch::nn::Linear first = seeded_linear(kIn, kHidden, 11);
  torch::nn::Linear second = seeded_linear(kHidden, kOut, 12);

  at::Tensor forward(const at::Tensor& x) { return second(at::gelu(first(x))); }
};

/// Input and upstream gradient shared by all ranks.
at::Tensor mlp_input() { return at::randn({kBatch, kIn}, seeded_generator(21)); }
at::Tensor mlp_upstream_grad() { return at::randn({kBatch, kOut}, seeded_generator(22)); }

/// Column -> GELU -> Row sharded from `dense` on this rank's tensor group; checks output, input
/// gradient and every parameter gradient against the dense run.
void check_parallel_mlp_matches_dense(const Mesh& mesh, bool gather_output) {
  DenseMlp dense;
  const at::Tensor input = mlp_input();
  const at::Tensor upstream = mlp_upstream_grad();

  const at::Tensor dense_x = input.clone().requires_grad_(true);
  const at::Tensor dense_y = dense.forward(dense_x);
  dense_y.backward(upstream);

  auto column = ColumnParallelLinearImpl::from_dense(
      dense.first,
      ColumnParallelLinearOptions(kIn, kHidden).gather_output(gather_output).group(mesh.tp_group));
  auto row = RowParallelLinearImpl::from_dense(dense.second,
                                               RowParallelLinearOptions(kHidden, kOut)
                                                   .input_is_parallel(!gather_output)
                                                   .group(mesh.tp_group));
  const at::Tensor x = input.clone().requires_grad_(true);
  const at::Tensor y = row(at::gelu(column(x)));
  y.backward(upstream);

  const int64_t t = mesh.tp_size();
  const int64_t r = mesh.tp_rank();
  const auto chunk = [&](const at::Tensor& full, int64_t dim) { return full.chunk(t, dim)[r]; };
  EXPECT_TRUE(all_close(y, dense_y)) << "output, rank " << mesh.rank;
  EXPECT_TRUE(all_close(x.grad(), dense_x.grad())) << "input grad, rank " << mesh.rank;
  EXPECT_TRUE(all_close(column->weight.grad(), chunk(dense.first->weight.grad(), 0)))
      << "column weight grad, rank " << mesh.rank;
  EXPECT_TRUE(all_close(column->bias.grad(), chunk(dense.first->bias.grad(), 0)))
      << "column bias grad, rank " << mesh.rank;
  EXPECT_TRUE(all_close(row->weight.grad(), chunk(dense.second->weight.grad(), 1)))
      << "row weight grad, rank " << mesh.rank;
  EXPECT_TRUE(all_close(row->bias.grad(), dense.second->bias.grad()))
      << "row bias grad, rank " << mesh.rank;
}

/// Parameterised by the world size; the tensor group spans the whole world.
class ParallelLinear : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
};

TEST_P(ParallelLinear, ColumnGeluRowMatchesDenseMlpOutputAndGradients) {
  testing::run_on_mesh(world(), testing::test_options(world()), [](const Mesh& mesh) {
    check_parallel_mlp_matches_dense(mesh, /*gather_output=*/false);
  });
}

TEST_P(ParallelLinear, GatheredColumnOutputIntoUnsplitRowInputMatchesDenseMlp) {
  testing::run_on_mesh(world(), testing::test_options(world()), [](const Mesh& mesh) {
    check_parallel_mlp_matches_dense(mesh, /*gather_output=*/true);
  });
}

TEST_P(ParallelLinear, ToDenseGivesBackTheShardedDenseLayers) {
  testing::run_on_mesh(world(), testing::test_options(world()), [](const Mesh& mesh) {
    DenseMlp dense;
    auto column = ColumnParallelLinearImpl::from_dense(
        dense.first, ColumnParallelLinearOptions(kIn, kHidden).group(mesh.tp_group));
    auto row = RowParallelLinearImpl::from_dense(
        dense.second, RowParallelLinearOptions(kHidden, kOut).group(mesh.tp_group));
    const torch::nn::Linear column_dense = column->to_dense();
    const torch::nn::Linear row_dense = row->to_dense();
    EXPECT_TRUE(at::equal(column_dense->weight, dense.first->weight)) << "rank " << mesh.rank;
    EXPECT_TRUE(at::equal(column_dense->bias, dense.first->bias)) << "rank " << mesh.rank;
    EXPECT_TRUE(at::equal(row_dense->weight, dense.second->weight)) << "rank " << mesh.rank;
    EXPECT_TRUE(at::equal(row_dense->bias, dense.second->bias)) << "rank " << mesh.rank;
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         ParallelLinear,
                         ::testing::Values(1, 2, 4),
                         testing::world_size_name);

/// Errors need more than one rank: every size is divisible by one.
class ParallelLinearOnSeveralRanks : public ParallelLinear {};

TEST_P(ParallelLinearOnSeveralRanks, ColumnRaisesAtConstructionWhenOutFeaturesIsNotDivisible) {
  const int t = world();
  const int64_t out_features = 3 * t + 1;
  const auto errors = testing::run_on_mesh_collecting_errors(
      t,
      [&](int) { return testing::test_options(t); },
      [&](const Mesh& mesh) {
        ColumnParallelLinear(ColumnParallelLinearOptions(kIn, out_features).group(mesh.tp_group));
      });
  testing::expect_every_rank_raised(
      errors, "out_features (" + std::to_string(out_features) + ") must be divisible");
}

TEST_P(ParallelLinearOnSeveralRanks, RowRaisesAtConstructionWhenInFeaturesIsNotDivisible) {
  const int t = world();
  const int64_t in_features = 3 * t + 1;
  const auto errors = testing::run_on_mesh_collecting_errors(
      t,
      [&](int) { return testing::test_options(t); },
      [&](const Mesh& mesh) {
        RowParallelLinear(RowParallelLinearOptions(in_features, kOut).group(mesh.tp_group));
      });
  testing::expect_every_rank_raised(
      errors, "in_features (" + std::to_string(in_features) + ") must be divisible");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         ParallelLinearOnSeveralRanks,
                         ::testing::Values(2, 4),
                         testing::world_size_name);

// A layer built for a tensor group of 2 (world 4, tp 2), applied over the world group of 4.
TEST(ParallelLinearGroupMismatch, ColumnFunctionRaisesWhenTheGroupSizeDiffersFromTheLayers) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      4,
      [](int) { return testing::test_options(2); },
      [](const Mesh& mesh) {
        ColumnParallelLinear layer(ColumnParallelLinearOptions(kIn, kHidden).group(mesh.tp_group));
        tensor_parallel::column_parallel_linear(at::zeros({kBatch, kIn}),
                                                layer->weight,
                                                layer->bias,
                                                kHidden,
                                                false,
                                                false,
                                                mesh.world);
      });
  testing::expect_every_rank_raised(errors, "tensor-parallel group of size 4");
}

TEST(ParallelLinearGroupMismatch, RowFunctionRaisesWhenTheGroupSizeDiffersFromTheLayers) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      4,
      [](int) { return testing::test_options(2); },
      [](const Mesh& mesh) {
        RowParallelLinear layer(RowParallelLinearOptions(kHidden, kOut).group(mesh.tp_group));
        tensor_parallel::row_parallel_linear(at::zeros({kBatch, kHidden / 4}),
                                             layer->weight,
                                             layer->bias,
                                             kHidden,
                                             true,
                                             false,
                                             mesh.world);
      });
  testing::expect_every_rank_raised(errors, "tensor-parallel group of size 4");
}

}  // namespace
}  // namespace torch_mp
