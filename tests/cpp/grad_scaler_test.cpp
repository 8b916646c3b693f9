// torch_mp::GradScaler: an overflow on one rank of the mesh (one tensor shard, one pipeline
// stage) skips the step on every rank and backs the scale off; clean steps unscale exactly and
// grow the scale after growth_interval of them; misuse is refused. Ranks are threads over real
// Gloo groups.

#include "torch_mp/optim/grad_scaler.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <string>
#include <vector>

#include "tensor_checks.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

// A step of SGD over one parameter whose gradient is `grad` times the scale (as a scaled loss
// gives), with an inf in it where `overflow`. Returns whether it stepped.
bool scaled_step(GradScaler& scaler, at::Tensor& p, const at::Tensor& grad, bool overflow) {
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.5));
  p.mutable_grad() = grad * scaler.get_scale();
  if (overflow) {
    p.mutable_grad()[0] = std::numeric_limits<float>::infinity();
  }
  const bool stepped = scaler.step(sgd);
  scaler.update();
  return stepped;
}

struct ScalerCase {
  int world;
  int64_t tp;
  int64_t pp;
};

class GradScalerOnMesh : public ::testing::TestWithParam<ScalerCase> {};

TEST_P(GradScalerOnMesh, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  const auto c = GetParam();
  testing::run_on_mesh(c.world, testing::test_options(c.tp, c.pp), [&](const Mesh& mesh) {
    GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(2),
                      mesh.tp_group,
                      mesh.pp_group,
                      mesh.dp_group);
    auto p = at::ones({3}).requires_grad_();
    const auto grad = at::full({3}, 0.25);
    // Step 1: the last rank overflows; nobody steps, the scale halves.
    EXPECT_FALSE(scaled_step(scaler, p, grad, mesh.rank == c.world - 1)) << mesh.rank;
    EXPECT_TRUE(at::equal(p, at::ones({3}))) << mesh.rank;
    EXPECT_EQ(scaler.get_scale(), 512);
    // Steps 2 and 3 are clean: exact unscaled steps (1 - 0.5 * 0.25, twice), and the scale
    // doubles after two of them.
    EXPECT_TRUE(scaled_step(scaler, p, grad, false));
    EXPECT_EQ(scaler.growth_tracker(), 1);
    EXPECT_TRUE(scaled_step(scaler, p, grad, false));
    EXPECT_TRUE(at::equal(p, at::full({3}, 0.75))) << mesh.rank;
    EXPECT_EQ(scaler.get_scale(), 1024);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes,
                         GradScalerOnMesh,
                         ::testing::Values(ScalerCase{1, 1, 1},
                                           ScalerCase{2, 2, 1},
                                           ScalerCase{2, 1, 2},
                                           ScalerCase{4, 2, 1},
                                           ScalerCase{4, 1, 2}),
                         [](const ::testing::TestParamInfo<ScalerCase>& info) {
                           const auto& c = info.param;
                           return "world" + std::to_string(c.world) + "_tp" + std::to_string(c.tp) +
                                  "_pp" + std::to_string(c.pp);
                         });

TEST(GradScaler, ScalesTheLossAndRefusesMisuse) {
  testing::run_on_mesh(1, testing::test_options(1), [](const Mesh& mesh) {
    GradScaler scaler(GradScalerOptions().init_scale(8), mesh.tp_group, mesh.pp_group, nullptr);
    EXPECT_TRUE(at::equal(scaler.scale(at::full({}, 0.5)), at::full({}, 4.0)));
    auto p = at::ones({2}).requires_grad_();
    p.mutable_grad() = at::full({2}, 8.0);
    EXPECT_FALSE(scaler.unscale_({p}));
    EXPECT_TRUE(at::equal(p.grad(), at::ones({2})));
    EXPECT_TRUE(
        testing::mentions(testing::error_of([&] { scaler.unscale_({p}); }), "already called"));
    scaler.update();
    EXPECT_TRUE(testing::mentions(testing::error_of([&] { scaler.update(); }), "without unscale_"));
    EXPECT_TRUE(testing::mentions(
        testing::error_of([] { GradScaler(GradScalerOptions().backoff_factor(2), {}, {}, {}); }),
        "backoff_factor must be in (0, 1)"));
    GradScaler off(GradScalerOptions().enabled(false), nullptr, nullptr, nullptr);
    EXPECT_TRUE(at::equal(off.scale(at::full({}, 0.5)), at::full({}, 0.5)));
    EXPECT_EQ(off.get_scale(), 1.0);
  });
}

}  // namespace
}  // namespace torch_mp
