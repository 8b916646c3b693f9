// The autograd collectives of collectives.h, each against its closed form: every thread
// recomputes all ranks' inputs and upstream gradients and builds the expected result locally.

#include "torch_mp/collectives.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"

namespace torch_mp {
namespace {

using testing::all_close;
using testing::all_ranks_randn;
using testing::sum_of;

constexpr uint64_t kInputSeed = 1000;
constexpr uint64_t kGradSeed = 2000;

/// A collective run forward and backward on one rank: its output and its input's gradient.
struct ForwardBackward {
  at::Tensor output;
  at::Tensor input_grad;
};

/// Applies `op` to `input` (made a leaf that requires grad) and back-propagates `upstream`.
ForwardBackward run_op(const std::function<at::Tensor(const at::Tensor&)>& op,
                       const at::Tensor& input,
                       const at::Tensor& upstream) {
  const at::Tensor x = input.clone().requires_grad_(true);
  const at::Tensor y = op(x);
  y.backward(upstream);
  return {y.detach(), x.grad()};
}

/// Parameterised by the world size; the tensor-parallel group spans the whole world.
class Collectives : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
  /// Runs `body` on every rank of a mesh whose tensor group is the whole world.
  void run(const testing::MeshBody& body) const {
    testing::run_on_mesh(world(), testing::test_options(world()), body);
  }
};

TEST_P(Collectives, CopyToTpIsIdentityForwardAndAllReducesTheGradient) {
  const int t = world();
  const auto inputs = all_ranks_randn({3, 4}, kInputSeed, t);
  const auto grads = all_ranks_randn({3, 4}, kGradSeed, t);
  run([&](const Mesh& mesh) {
    const int64_t r = mesh.tp_rank();
    const auto result = run_op(
        [&](const at::Tensor& x) { return copy_to_tp(x, mesh.tp_group); }, inputs[r], grads[r]);
    EXPECT_TRUE(all_close(result.output, inputs[r])) << "forward, rank " << r;
    EXPECT_TRUE(all_close(result.input_grad, sum_of(grads))) << "backward, rank " << r;
  });
}

TEST_P(Collectives, ReduceFromTpAllReducesForwardAndPassesTheGradientThrough) {
  const int t = world();
  const auto inputs = all_ranks_randn({3, 4}, kInputSeed, t);
  const auto grads = all_ranks_randn({3, 4}, kGradSeed, t);
  run([&](const Mesh& mesh) {
    const int64_t r = mesh.tp_rank();
    const auto result = run_op(
        [&](const at::Tensor& x) { return reduce_from_tp(x, mesh.tp_group); }, inputs[r], grads[r]);
    EXPECT_TRUE(all_close(result.output, sum_of(inputs))) << "forward, rank " << r;
    EXPECT_TRUE(all_close(result.input_grad, grads[r])) << "backward, rank " << r;
  });
}

TEST_P(Collectives, ScatterToTpKeepsOwnChunkAndAllGathersTheGradient) {
  const int t = world();
  const auto inputs = all_ranks_randn({3, 4 * t}, kInputSeed, t);
  const auto grads = all_ranks_randn({3, 4}, kGradSeed, t);
  run([&](const Mesh& mesh) {
    const int64_t r = mesh.tp_rank();
    const auto result =
        run_op([&](const at::Tensor& x) { return scatter_to_tp(x, mesh.tp_group, -1); },
               inputs[r],
               grads[r]);
    EXPECT_TRUE(all_close(result.output, inputs[r].narrow(1, 4 * r, 4))) << "forward, rank " << r;
    EXPECT_TRUE(all_close(result.input_grad, at::cat(grads, 1))) << "backward, rank " << r;
  });
}

TEST_P(Collectives, GatherFromTpAllGathersAndKeepsOwnChunkOfTheGradient) {
  const int t = world();
  const auto inputs = all_ranks_randn({3, 4}, kInputSeed, t);
  const auto grads = all_ranks_randn({3, 4 * t}, kGradSeed, t);
  run([&](const Mesh& mesh) {
    const int64_t r = mesh.tp_rank();
    const auto result =
        run_op([&](const at::Tensor& x) { return gather_from_tp(x, mesh.tp_group, -1); },
               inputs[r],
               grads[r]);
    EXPECT_TRUE(all_close(result.output, at::cat(inputs, 1))) << "forward, rank " << r;
    EXPECT_TRUE(all_close(result.input_grad, grads[r].narrow(1, 4 * r, 4)))
        << "backward, rank " << r;
  });
}

TEST_P(Collectives, GatherFromSpAllGathersTheSequenceAndReduceScattersTheGradient) {
  const int t = world();
  const auto inputs = all_ranks_randn({2, 3}, kInputSeed, t);
  const auto grads = all_ranks_randn({2 * t, 3}, kGradSeed, t);
  run([&](const Mesh& mesh) {
    const int64_t r = mesh.tp_rank();
    const auto result =
        run_op([&](const at::Tensor& x) { return gather_from_sp(x, mesh.tp_group, 0); },
               inputs[r],
               grads[r]);
    EXPECT_TRUE(all_close(result.output, at::cat(inputs, 0))) << "forward, rank " << r;
    EXPECT_TRUE(all_close(result.input_grad, sum_of(grads).narrow(0, 2 * r, 2)))
        << "backward, rank " << r;
  });
}

TEST_P(Collectives, ReduceScatterToSpReduceScattersTheSequenceAndAllGathersTheGradient) {
  const int t = world();
  const auto inputs = all_ranks_randn({2 * t, 3}, kInputSeed, t);
  const auto grads = all_ranks_randn({2, 3}, kGradSeed, t);
  run([&](const Mesh& mesh) {
    const int64_t r = mesh.tp_rank();
    const auto result =
        run_op([&](const at::Tensor& x) { return reduce_scatter_to_sp(x, mesh.tp_group, 0); },
               inputs[r],
               grads[r]);
    EXPECT_TRUE(all_close(result.output, sum_of(inputs).narrow(0, 2 * r, 2)))
        << "forward, rank " << r;
    EXPECT_TRUE(all_close(result.input_grad, at::cat(grads, 0))) << "backward, rank " << r;
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         Collectives,
                         ::testing::Values(1, 2, 4),
                         testing::world_size_name);

/// Errors need more than one rank: on a group of one every op is the identity.
class CollectivesOnSeveralRanks : public Collectives {};

TEST_P(CollectivesOnSeveralRanks, ScatterToTpRaisesOnEveryRankWhenTheSizeIsNotDivisible) {
  const int t = world();
  const auto errors = testing::run_on_mesh_collecting_errors(
      t,
      [&](int) { return testing::test_options(t); },
      [&](const Mesh& mesh) { scatter_to_tp(at::zeros({3, 2 * t + 1}), mesh.tp_group, -1); });
  testing::expect_every_rank_raised(
      errors, "is not divisible by the group size (" + std::to_string(t) + ")");
}

TEST_P(CollectivesOnSeveralRanks, ReduceScatterToSpRaisesOnEveryRankWhenTheSizeIsNotDivisible) {
  const int t = world();
  const auto errors = testing::run_on_mesh_collecting_errors(
      t,
      [&](int) { return testing::test_options(t); },
      [&](const Mesh& mesh) { reduce_scatter_to_sp(at::zeros({2 * t + 1, 3}), mesh.tp_group, 0); });
  testing::expect_every_rank_raised(
      errors, "is not divisible by the group size (" + std::to_string(t) + ")");
}

TEST_P(CollectivesOnSeveralRanks, WithTheChecksOnATensorOffTheGroupsDeviceIsRefused) {
  // What an NCCL group could not carry (a CPU tensor there) is caught on Gloo too: here a tensor
  // on the meta device, given to a Gloo group, whose tensors live on the CPU.
  const int t = world();
  set_check_collectives(true);
  const auto errors = testing::run_on_mesh_collecting_errors(
      t,
      [&](int) { return testing::test_options(t); },
      [&](const Mesh& mesh) { comm::all_reduce(at::zeros({4}, at::kMeta), mesh.tp_group); });
  set_check_collectives(false);
  testing::expect_every_rank_raised(
      errors, "was given a tensor on meta, but its group (gloo) carries cpu tensors");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         CollectivesOnSeveralRanks,
                         ::testing::Values(2, 4),
                         testing::world_size_name);

}  // namespace
}  // namespace torch_mp
