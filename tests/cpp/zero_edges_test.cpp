// ZeRO and DataParallel at the edges, from C++: a dropped backward leaves nothing behind once a
// zero_grad ran; a parameter that got no gradient, or that no DataParallel reduces, is refused
// by name on every rank; a 0-dim parameter (a learned scalar) steps and reloads under the
// distributed optimizer as under a plain one. Ranks are threads over real Gloo groups.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <string>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/checkpoint/checkpoint.h"
#include "torch_mp/data_parallel/data_parallel.h"
#include "torch_mp/optim/distributed_optimizer.h"

namespace torch_mp {
namespace {

using testing::all_close;

constexpr int64_t kWidth = 6;

void fill(torch::nn::Module& module, uint64_t seed) {
  at::NoGradGuard no_grad;
  auto generator = testing::seeded_generator(seed);
  for (auto& p : module.parameters()) {
    p.uniform_(-0.5, 0.5, generator);
  }
}

// Two linear layers drawn from their own generator (threads share the global one).
torch::nn::Sequential two_layers() {
  torch::nn::Sequential model(torch::nn::Linear(kWidth, 2 * kWidth),
                              torch::nn::Linear(2 * kWidth, kWidth));
  fill(*model, 3);
  return model;
}

// A linear layer times a learned scalar (a 0-dim parameter).
struct ScaledImpl : torch::nn::Module {
  ScaledImpl() {
    linear = register_module("linear", torch::nn::Linear(kWidth, kWidth));
    scale = register_parameter("scale", at::tensor(0.5));
    fill(*linear, 5);
  }
  at::Tensor forward(const at::Tensor& x) { return linear->forward(x) * scale; }
  torch::nn::Linear linear{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Scaled);

at::Tensor loss_of(const at::Tensor& out, int64_t seed) {
  return (out - testing::rank_randn(out.sizes(), seed, 0)).pow(2).mean();
}

// Every rank takes the same batch: the averaged gradients are then the one-process ones.
at::Tensor batch(int64_t seed) { return testing::rank_randn({4, kWidth}, seed, 0); }

class ZeroEdges : public ::testing::TestWithParam<int> {};

TEST_P(ZeroEdges, ZeroGradDropsTheMainGradientsOfADroppedBackward) {
  for (const bool through_module : {false, true}) {
    testing::run_on_mesh(GetParam(), testing::test_options(1), [&](const Mesh& mesh) {
      auto reference = two_layers();
      auto model = two_layers();
      DataParallel dp(model.ptr(),
                      DataParallelOptions().group(mesh.dp_group).grad_dtype(at::kFloat));
      DistributedOptimizer zero(model->parameters(),
                                torch::optim::SGDOptions(0.1),
                                DistributedOptimizerOptions().group(mesh.dp_group));
      dp->prepare_for_forward();  // not armed: as under no_sync
      loss_of(model->forward(batch(1)), 2).backward();
      through_module ? dp->zero_grad() : zero.zero_grad();
      dp->prepare_for_forward();
      auto loss = loss_of(model->forward(batch(3)), 4);
      dp->prepare_for_backward();
      loss.backward();
      zero.step();

      torch::optim::SGD plain(reference->parameters(), torch::optim::SGDOptions(0.1));
      loss_of(reference->forward(batch(3)), 4).backward();
      plain.step();
      const auto expected = reference->parameters();
      const auto actual = model->parameters();
      for (size_t i = 0; i < actual.size(); ++i) {
        EXPECT_TRUE(all_close(actual[i], expected[i]))
            << "parameter " << i << " (zero_grad of the "
            << (through_module ? "module" : "optimizer") << ")";
      }
    });
  }
}

TEST_P(ZeroEdges, AScalarParameterStepsAfterACheckpointLoad) {
  const auto path = ::testing::TempDir() + "/torch_mp_zero_edges_scalar";
  std::filesystem::remove_all(path);
  testing::run_on_mesh(GetParam(), testing::test_options(1), [&](const Mesh& mesh) {
    Scaled reference;
    torch::optim::AdamW plain(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    const auto options = DistributedOptimizerOptions().group(mesh.dp_group);
    const auto shared = std::make_shared<Mesh>(mesh);
    const auto step = [](DataParallel& dp, torch::optim::Optimizer& optimizer, int64_t seed) {
      optimizer.zero_grad();
      loss_of(dp->forward(batch(seed)), seed + 50).backward();
      optimizer.step();
    };
    Scaled model;
    DataParallel dp(model, DataParallelOptions().group(mesh.dp_group));
    DistributedOptimizer zero(model->parameters(), torch::optim::AdamWOptions(1e-2), options);
    for (int64_t s = 0; s < 2; ++s) {
      step(dp, zero, 10 + s);
    }
    checkpoint::save(path, {{model.ptr()}}, &zero, {}, shared);

    Scaled restored;  // the same initial values; the load replaces them anyway
    DataParallel restored_dp(restored, DataParallelOptions().group(mesh.dp_group));
    DistributedOptimizer restored_zero(
        restored->parameters(), torch::optim::AdamWOptions(1e-2), options);
    checkpoint::load(path, {{restored.ptr()}}, &restored_zero, shared);
    step(restored_dp, restored_zero, 12);

    for (int64_t s = 0; s < 3; ++s) {
      plain.zero_grad();
      loss_of(reference->forward(batch(10 + s)), 60 + s).backward();
      plain.step();
    }
    EXPECT_TRUE(all_close(restored->scale, reference->scale)) << "the scalar";
    EXPECT_TRUE(all_close(restored->linear->weight, reference->linear->weight)) << "the weight";
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ZeroEdges, ::testing::Values(1, 2), testing::world_size_name);

// Runs `body` on two ranks; expects every rank to raise with `expected` in its message.
void expect_refused_on_every_rank(const testing::MeshBody& body, const std::string& expected) {
  const auto errors =
      testing::run_on_mesh_collecting_errors(2, [](int) { return testing::test_options(1); }, body);
  for (const auto& error : errors) {
    ASSERT_TRUE(error.has_value()) << "not refused";
    EXPECT_NE(error->find(expected), std::string::npos) << *error;
  }
}

TEST(ZeroEdges, AParameterWithoutGradientIsRefusedAtTheDistributedOptimizersStep) {
  expect_refused_on_every_rank(
      [](const Mesh& mesh) {
        auto model = two_layers();
        DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group));
        DistributedOptimizer zero(model->parameters(),
                                  torch::optim::AdamWOptions(1e-2),
                                  DistributedOptimizerOptions().group(mesh.dp_group));
        dp->prepare_for_forward();
        auto loss = model->ptr<torch::nn::LinearImpl>(0)->forward(batch(1)).pow(2).mean();
        dp->prepare_for_backward();
        loss.backward();  // the second layer gets no gradient
        zero.step();
      },
      "gave no gradient to 2 parameters (1.weight [6, 12], 1.bias [6])");
}

TEST(ZeroEdges, AParameterWithoutGradientIsNamedAtTheNextForward) {
  expect_refused_on_every_rank(
      [](const Mesh& mesh) {
        auto model = two_layers();
        DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group));
        for (int step = 0; step < 2; ++step) {
          dp->prepare_for_forward();
          auto loss = model->ptr<torch::nn::LinearImpl>(0)->forward(batch(1)).pow(2).mean();
          dp->prepare_for_backward();
          loss.backward();
        }
      },
      "1.weight [6, 12]");
}

TEST(ZeroEdges, AParameterOutsideTheDataParallelModuleIsRefused) {
  expect_refused_on_every_rank(
      [](const Mesh& mesh) {
        auto model = two_layers();
        DataParallel dp(model->ptr(0), DataParallelOptions().group(mesh.dp_group));
        DistributedOptimizer zero(model->parameters(),
                                  torch::optim::AdamWOptions(1e-2),
                                  DistributedOptimizerOptions().group(mesh.dp_group));
        dp->prepare_for_forward();
        auto loss = loss_of(model->forward(batch(1)), 2);
        dp->prepare_for_backward();
        loss.backward();
        zero.step();
      },
      "parameter 2 [6, 12] is not in a torch_mp.DataParallel");
}

}  // namespace
}  // namespace torch_mp
