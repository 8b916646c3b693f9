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
constexpr int64_t kPipelineBatch = 16;

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
  const auto x = testing::rank_randn({kPipelineBatch, kWidth}, 1, 0);
  const auto y = testing::rank_randn({kPipelineBatch, kWidth}, 2, 0);
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
    const auto schedule = pipeline::make_schedule(name, num_stages, 2 * world, per_rank);
    const auto indices = schedule.stages_of_rank(rank);  // zbv: rank 0 holds first and last
    for (int64_t s : indices) {
      mine.push_back(seeded_stage(s));
      stages.push_back(pipeline::stage_of(mine.back()));
    }
    pipeline::Pipeline pipe(std::move(stages), mse, schedule, mesh.pp_group);
    const bool first = schedule.rank_of_stage(0) == rank;
    const bool last = schedule.rank_of_stage(num_stages - 1) == rank;
    const auto loss = pipe.step(first ? std::vector<at::Tensor>{x} : std::vector<at::Tensor>{},
                                last ? std::vector<at::Tensor>{y} : std::vector<at::Tensor>{});
    EXPECT_EQ(loss.has_value(), last);
    if (loss) {
      EXPECT_TRUE(all_close(*loss, expected.detach())) << "loss";
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto got = mine[i]->parameters();
      const auto want = whole[indices[i]]->parameters();
      for (size_t j = 0; j < got.size(); ++j) {
        EXPECT_TRUE(all_close(got[j].grad(), want[j].grad()))
            << name << ": stage " << indices[i] << " parameter " << j;
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
                                           ScheduleCase{"zb_h1", 4, 1},
                                           ScheduleCase{"interleaved_zb", 2, 2},
                                           ScheduleCase{"zbv", 2, 2}),
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

TEST(PipelineExecutorErrors, AFailureReachesEveryRankAtOnceAndResetRecovers) {
  // Rank 1's stage throws in its second forward: both ranks raise well before the 20 s group
  // timeout, naming rank 1, stage 1 and micro-batch 1; after reset() a step equals the model's.
  const auto x = testing::rank_randn({kPipelineBatch, kWidth}, 1, 0);
  const auto y = testing::rank_randn({kPipelineBatch, kWidth}, 2, 0);
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return InitOptions().pp(2).timeout(std::chrono::seconds(20)); },
      [&](const Mesh& mesh) {
        const int64_t rank = mesh.pp_rank();
        std::vector<torch::nn::Sequential> whole{seeded_stage(0), seeded_stage(1)};
        const auto expected = mse({whole[1]->forward(whole[0]->forward(x))}, {y});
        expected.backward();
        auto mine = seeded_stage(rank);
        int calls = 0;
        bool inject = rank == 1;
        pipeline::Stage stage{[&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
                                TORCH_CHECK(!(inject && calls++ == 1), "injected failure");
                                return {mine->forward(in[0])};
                              },
                              mine->parameters(),
                              {}};
        pipeline::Pipeline pipe(
            {stage}, mse, pipeline::PipelineOptions().num_microbatches(4).group(mesh.pp_group));
        const auto inputs = rank == 0 ? std::vector<at::Tensor>{x} : std::vector<at::Tensor>{};
        const auto targets = rank == 1 ? std::vector<at::Tensor>{y} : std::vector<at::Tensor>{};
        const auto start = std::chrono::steady_clock::now();
        const auto error = testing::error_of([&] { pipe.step(inputs, targets); });
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
        EXPECT_TRUE(testing::mentions(error, "stage 1 (rank 1) failed on micro-batch 1 in F(1,1)"))
            << error.value_or("");
        EXPECT_TRUE(testing::mentions(error, "injected failure")) << error.value_or("");
        if (rank == 0) {
          EXPECT_TRUE(testing::mentions(error, "because the step failed on rank 1"))
              << error.value_or("");
        }
        pipe.reset(mesh.store, "executor_test");
        inject = false;
        for (auto& p : mine->parameters()) {
          p.mutable_grad() = at::Tensor();
        }
        const auto loss = pipe.step(inputs, targets);
        if (loss) {
          EXPECT_TRUE(all_close(*loss, expected.detach())) << "loss after reset";
        }
        const auto got = mine->parameters();
        const auto want = whole[rank]->parameters();
        for (size_t j = 0; j < got.size(); ++j) {
          EXPECT_TRUE(all_close(got[j].grad(), want[j].grad())) << "parameter " << j;
        }
      });
  EXPECT_FALSE(errors[0].has_value()) << *errors[0];
  EXPECT_FALSE(errors[1].has_value()) << *errors[1];
}

}  // namespace
}  // namespace torch_mp
