// torch_mp::DataParallel from C++: gradients averaged over the data group equal those of the
// whole batch on one thread, with gradient accumulation, as a pipeline stage too. Ranks are
// threads over real Gloo groups.

#include "torch_mp/data_parallel/data_parallel.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/pipeline/pipeline.h"

namespace torch_mp {
namespace {

using testing::all_close;
using testing::seeded_generator;

constexpr int64_t kFeatures = 8;

// Threads share the global generator, so layers are drawn from their own.
torch::nn::Linear seeded_linear(uint64_t seed) {
  torch::nn::Linear linear(kFeatures, kFeatures);
  at::NoGradGuard no_grad;
  auto generator = seeded_generator(seed);
  linear->weight.uniform_(-0.3, 0.3, generator);
  linear->bias.uniform_(-0.3, 0.3, generator);
  return linear;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

class DataParallelWorld : public ::testing::TestWithParam<int> {};

TEST_P(DataParallelWorld, AccumulatedGradientsEqualTheWholeBatch) {
  const int world = GetParam();
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    const int64_t rank = mesh.dp_rank();
    auto reference = seeded_linear(100);
    auto model = seeded_linear(100 + rank);  // construction copies rank 0's parameters
    DataParallel dp(model, DataParallelOptions().group(mesh.dp_group).bucket_cap_mb(1e-4));
    EXPECT_TRUE(at::equal(model->weight, reference->weight)) << "not broadcast from rank 0";
    for (int step = 0; step < 3; ++step) {  // buckets are rebuilt after the first step
      const auto x = testing::rank_randn({4 * world, kFeatures}, 10 + step, 0);
      const auto y = testing::rank_randn({4 * world, kFeatures}, 20 + step, 0);
      reference->zero_grad();
      mse(reference->forward(x), y).backward();
      dp->zero_grad();
      const auto xs = x.chunk(world)[rank].chunk(2);
      const auto ys = y.chunk(world)[rank].chunk(2);
      {
        auto no_sync = dp->no_sync();
        (mse(dp->forward(xs[0]), ys[0]) / 2).backward();
      }
      (mse(dp->forward(xs[1]), ys[1]) / 2).backward();
      EXPECT_TRUE(all_close(model->weight.grad(), reference->weight.grad())) << "step " << step;
      EXPECT_TRUE(all_close(model->bias.grad(), reference->bias.grad())) << "step " << step;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds,
                         DataParallelWorld,
                         ::testing::Values(1, 2, 4),
                         testing::world_size_name);

class DataParallelStage : public ::testing::TestWithParam<const char*> {};

TEST_P(DataParallelStage, PipelineOfDataParallelStagesEqualsTheWholeModel) {
  const char* schedule = GetParam();
  constexpr int64_t kMicrobatches = 4;
  testing::run_on_mesh(4, testing::test_options(1, 2), [&](const Mesh& mesh) {
    const int64_t stage = mesh.pp_rank();
    std::vector<torch::nn::Linear> whole{seeded_linear(200), seeded_linear(201)};
    auto mine = seeded_linear(200 + stage);
    DataParallel dp(mine, DataParallelOptions().group(mesh.dp_group));
    pipeline::Pipeline pipe(
        {pipeline::stage_of(dp)},
        [](const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& target) {
          return mse(out[0], target[0]);
        },
        pipeline::PipelineOptions()
            .schedule(schedule)
            .num_microbatches(kMicrobatches)
            .group(mesh.pp_group));
    for (int step = 0; step < 2; ++step) {
      const auto x = testing::rank_randn({4 * kMicrobatches, kFeatures}, 30 + step, 0);
      const auto y = testing::rank_randn({4 * kMicrobatches, kFeatures}, 40 + step, 0);
      for (auto& layer : whole) {
        layer->zero_grad();
      }
      mse(whole[1]->forward(whole[0]->forward(x)), y).backward();
      dp->zero_grad();
      const auto half = [&](const at::Tensor& t) { return t.chunk(2)[mesh.dp_rank()]; };
      pipe.step(stage == 0 ? std::vector<at::Tensor>{half(x)} : std::vector<at::Tensor>{},
                stage == 1 ? std::vector<at::Tensor>{half(y)} : std::vector<at::Tensor>{});
      EXPECT_TRUE(all_close(mine->weight.grad(), whole[stage]->weight.grad()))
          << schedule << " step " << step << " stage " << stage;
      EXPECT_TRUE(all_close(mine->bias.grad(), whole[stage]->bias.grad()))
          << schedule << " step " << step << " stage " << stage;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Schedules,
                         DataParallelStage,
                         ::testing::Values("gpipe", "1f1b", "zb_h1"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace torch_mp
