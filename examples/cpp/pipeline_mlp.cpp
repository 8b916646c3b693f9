// Trains a 4-layer MLP cut into pipeline stages (one per rank, 1F1B, 8 micro-batches) next to
// the whole model on one process, and checks that losses and gradients agree.
//
//   torchrun --standalone --no-python --nproc-per-node=2 build/examples/cpp/pipeline_mlp
//
// Every rank builds the same model from a fixed seed and keeps the layers of its stage(s); the
// whole model is also trained on every rank as the reference. Exits non-zero on a mismatch.

#include <torch/torch.h>
#include <torch_mp/torch_mp.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

namespace pp = torch_mp::pipeline;

constexpr int64_t kWidth = 16;
constexpr int64_t kLayers = 4;
constexpr int64_t kBatch = 32;
constexpr int64_t kMicrobatches = 8;
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;

int64_t env(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value, name, " is not set: run this program with torchrun --no-python");
  return std::stoll(value);
}

int run() {
  const int64_t world = env("WORLD_SIZE");
  TORCH_CHECK(kLayers % world == 0, "run on 1, 2 or 4 ranks");
  auto mesh = torch_mp::init(torch_mp::InitOptions().pp(world).timeout(std::chrono::seconds(60)));
  const int64_t rank = mesh->pp_rank();

  torch::manual_seed(0);
  std::vector<torch::nn::Linear> layers;
  torch::nn::Sequential reference;
  for (int64_t i = 0; i < kLayers; ++i) {
    layers.emplace_back(kWidth, kWidth);
    reference->push_back(layers.back());
    reference->push_back(torch::nn::Tanh());
  }
  // This rank's stage: copies of its layers.
  const int64_t layers_per_stage = kLayers / world;
  torch::nn::Sequential stage;
  for (int64_t i = rank * layers_per_stage; i < (rank + 1) * layers_per_stage; ++i) {
    stage->push_back(
        torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(layers[i]->clone())));
    stage->push_back(torch::nn::Tanh());
  }

  const auto x = torch::randn({kBatch, kWidth});
  const auto y = torch::randn({kBatch, kWidth});
  auto mse = [](const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& target) {
    return torch::mse_loss(out[0], target[0]);
  };
  pp::Pipeline pipe({pp::stage_of(stage)},
                    mse,
                    pp::PipelineOptions().schedule("1f1b").num_microbatches(kMicrobatches));
  torch::optim::SGD reference_sgd(reference->parameters(), 0.1);
  torch::optim::SGD stage_sgd(stage->parameters(), 0.1);

  double worst = 0;
  for (int step = 1; step <= kSteps; ++step) {
    reference_sgd.zero_grad();
    stage_sgd.zero_grad();
    const auto expected = torch::mse_loss(reference->forward(x), y);
    expected.backward();
    const auto loss =
        pipe.step(rank == 0 ? std::vector<at::Tensor>{x} : std::vector<at::Tensor>{},
                  rank == world - 1 ? std::vector<at::Tensor>{y} : std::vector<at::Tensor>{});
    // Gradients of this rank's layers against the reference's.
    const auto mine = stage->parameters();
    const auto all = reference->parameters();
    const int64_t first = rank * layers_per_stage * 2;  // two parameters per Linear
    for (size_t i = 0; i < mine.size(); ++i) {
      worst = std::max(worst, (mine[i].grad() - all[first + i].grad()).abs().max().item<double>());
    }
    if (loss) {
      const double diff = std::abs(loss->item<double>() - expected.item<double>());
      worst = std::max(worst, diff);
      std::printf("step %d: pipeline loss %.6f (one-process reference %.6f, |diff| %.2e)\n",
                  step,
                  loss->item<double>(),
                  expected.item<double>(),
                  diff);
    }
    reference_sgd.step();
    stage_sgd.step();
  }
  const bool ok = worst <= kTolerance;
  std::printf("rank %ld: worst difference from the reference %.2e: %s\n",
              static_cast<long>(rank),
              worst,
              ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_mlp: %s\n", e.what());
    return 1;
  }
}
