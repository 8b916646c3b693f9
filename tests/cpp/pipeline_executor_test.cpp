// The pipeline engine from C++: every schedule's loss and parameter gradients against the
// whole model run in the same thread, ranks as threads over real Gloo groups.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/pipeline/pipeline.h"

namespace torch_mp {
namespace {

using testing::all_close;
using testing::seeded_generator;

constexpr int64_t kWidth = 8;
constexpr int64_t kBatch = 16;

/// Stage `index` of the model: Linear + Tanh, drawn from its own seed (threads share the global
/// generator, so it is not used).
torch::nn::Sequential seeded_stage(int64_t index) {
  torch::nn::Linear linear(kWidth, kWidth);
  at::NoGradGuard no_grad;
  auto generator = seeded_generator(100 + index);
  linear->weight.uniform_(-0.3, 0.3, generator);
  linear->bias.uniform_(-0.3, 0.3, generator);
  return torch::nn::Sequential(linear, torch::nn::Tanh());
}

at::Tensor mse(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& target) {
  return (out[0] - target[0]).pow(2).mean();
}

struct ScheduleCase {
  const char* name;
  int64_t world;
  int64_t stages_per_rank;
};

class PipelineExecutor : public ::testing::TestWithParam<ScheduleCase> {};

TEST_P(PipelineExecutor, LossAndGradientsEqualTheWholeModel) {
  const auto [name, world, per_rank] = GetParam();
  const int64_t num_stages = world * per_rank;
  const auto x = testing::rank_randn({kBatch, kWidth}, 1, 0);
  const auto y = testing::rank_randn({kBatch, kWidth}, 2, 0);
  testing::run_on_mesh(world, testing::test_options(1, world), [&](const Mesh& mesh) {
    const int64_t rank = mesh.pp_rank();
    // The reference: all stages in a row, on this thread alone.
    std::vector<torch::nn::Sequential> whole;
    at::Tensor h = x;
    for (int64_t s = 0; s < num_stages; ++s) {
      whole.push_back(seeded_stage(s));
      h = whole.back()->forward(h);
    }
    const auto expected = mse({h}, {y});
    expected.backward();

    std::vector<torch::nn::Sequential> mine;
    std::vector<pipeline::Stage> stages;
    for (int64_t s = rank; s < num_stages; s += world) {
      mine.push_back(seeded_stage(s));
      stages.push_back(pipeline::stage_of(mine.back()));
    }
    pipeline::Pipeline pipe(
        std::move(stages),
        mse,
        pipeline::PipelineOptions().schedule(name).num_microbatches(2 * world).group(
            mesh.pp_group));
    const auto loss =
        pipe.step(rank == 0 ? std::vector<at::Tensor>{x} : std::vector<at::Tensor>{},
                  rank == world - 1 ? std::vector<at::Tensor>{y} : std::vector<at::Tensor>{});
    EXPECT_EQ(loss.has_value(), rank == world - 1);
    if (loss) {
      EXPECT_TRUE(all_close(*loss, expected.detach())) << "loss";
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto got = mine[i]->parameters();
      const auto want = whole[rank + i * world]->parameters();
      for (size_t j = 0; j < got.size(); ++j) {
        EXPECT_TRUE(all_close(got[j].grad(), want[j].grad()))
            << name << ": stage " << rank + i * world << " parameter " << j;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Schedules,
                         PipelineExecutor,
                         ::testing::Values(ScheduleCase{"gpipe", 2, 1},
                                           ScheduleCase{"1f1b", 2, 1},
                                           ScheduleCase{"1f1b", 4, 1},
                                           ScheduleCase{"interleaved_1f1b", 2, 2},
                                           ScheduleCase{"zb_h1", 2, 1},
                                           ScheduleCase{"zb_h1", 4, 1}),
                         [](const ::testing::TestParamInfo<ScheduleCase>& info) {
                           return std::string(info.param.name) + "_world" +
                                  std::to_string(info.param.world);
                         });

TEST(PipelineExecutorErrors, AStageThatCannotTakeItsInputNamesBothStages) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return InitOptions().pp(2).timeout(std::chrono::seconds(3)); },
      [](const Mesh& mesh) {
        const int64_t rank = mesh.pp_rank();
        // Stage 0 emits kWidth features, stage 1 expects 2 * kWidth.
        torch::nn::Sequential stage(torch::nn::Linear(rank == 0 ? kWidth : 2 * kWidth, kWidth));
        pipeline::Pipeline pipe(
            {pipeline::stage_of(stage)},
            mse,
            pipeline::PipelineOptions().num_microbatches(2).group(mesh.pp_group));
        const auto x = at::ones({4, kWidth});
        pipe.step(rank == 0 ? std::vector<at::Tensor>{x} : std::vector<at::Tensor>{},
                  rank == 1 ? std::vector<at::Tensor>{x} : std::vector<at::Tensor>{});
      });
  ASSERT_TRUE(errors[1].has_value());
  EXPECT_TRUE(testing::mentions(errors[1], "stage 1 (rank 1) failed on micro-batch 0"));
  EXPECT_TRUE(testing::mentions(errors[1], "from stage 0 (rank 0)"));
  EXPECT_TRUE(errors[0].has_value()) << "the sender must stop at the timeout, not hang";
}

}  // namespace
}  // namespace torch_mp
