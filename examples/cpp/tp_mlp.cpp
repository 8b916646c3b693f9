// Trains a tensor-parallel MLP next to its dense twin and checks that they stay equal.
//
//   torchrun --standalone --no-python --nproc-per-node=2 build/examples/cpp/tp_mlp
//
// Every rank builds the same dense MLP (Linear 16->32, GELU, Linear 32->8) from a fixed seed,
// shards it into ColumnParallelLinear -> GELU -> RowParallelLinear over all ranks, and trains
// both copies for a few SGD steps on the same data. Rank 0 prints both losses per step; at the
// end the parallel layers are gathered back (to_dense) and compared with the dense ones. The exit
// status is non-zero if any difference exceeds kTolerance.

#include <torch/torch.h>
#include <torch_mp/torch_mp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using torch_mp::tensor_parallel::ColumnParallelLinear;
using torch_mp::tensor_parallel::ColumnParallelLinearImpl;
using torch_mp::tensor_parallel::ColumnParallelLinearOptions;
using torch_mp::tensor_parallel::RowParallelLinear;
using torch_mp::tensor_parallel::RowParallelLinearImpl;
using torch_mp::tensor_parallel::RowParallelLinearOptions;

constexpr int64_t kIn = 16;
constexpr int64_t kHidden = 32;
constexpr int64_t kOut = 8;
constexpr int64_t kBatch = 4;
constexpr int kSteps = 5;
constexpr double kLearningRate = 0.1;
constexpr double kTolerance = 1e-5;

/// The number of ranks torchrun started (WORLD_SIZE); raises when not started by torchrun.
int64_t world_size_from_env() {
  const char* value = std::getenv("WORLD_SIZE");
  if (value == nullptr || *value == '\0') {
    throw std::runtime_error(
        "WORLD_SIZE is not set: run this program with torchrun "
        "(torchrun --standalone --no-python --nproc-per-node=2 tp_mlp)");
  }
  return std::stoll(value);
}

/// Largest absolute elementwise difference between two tensors.
double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

int run() {
  const int64_t world_size = world_size_from_env();
  auto mesh =
      torch_mp::init(torch_mp::InitOptions().tp(world_size).timeout(std::chrono::seconds(60)));
  const bool is_rank0 = mesh->rank == 0;

  // The same dense model and data on every rank: one fixed seed, drawn in the same order.
  torch::manual_seed(0);
  torch::nn::Linear dense_first(kIn, kHidden);
  torch::nn::Linear dense_second(kHidden, kOut);
  const torch::Tensor inputs = torch::randn({kBatch, kIn});
  const torch::Tensor targets = torch::randn({kBatch, kOut});

  ColumnParallelLinear column = ColumnParallelLinearImpl::from_dense(
      dense_first, ColumnParallelLinearOptions(kIn, kHidden).group(mesh->tp_group));
  RowParallelLinear row = RowParallelLinearImpl::from_dense(
      dense_second, RowParallelLinearOptions(kHidden, kOut).group(mesh->tp_group));

  std::vector<torch::Tensor> dense_parameters = dense_first->parameters();
  for (const auto& p : dense_second->parameters()) {
    dense_parameters.push_back(p);
  }
  std::vector<torch::Tensor> parallel_parameters = column->parameters();
  for (const auto& p : row->parameters()) {
    parallel_parameters.push_back(p);
  }
  torch::optim::SGD dense_optimizer(dense_parameters, kLearningRate);
  torch::optim::SGD parallel_optimizer(parallel_parameters, kLearningRate);

  if (is_rank0) {
    std::printf("tp_mlp: %lld rank(s), tensor-parallel size %lld\n",
                static_cast<long long>(world_size),
                static_cast<long long>(mesh->tp_size()));
  }
  double worst = 0.0;
  for (int step = 1; step <= kSteps; ++step) {
    dense_optimizer.zero_grad();
    const torch::Tensor dense_loss =
        torch::mse_loss(dense_second(torch::gelu(dense_first(inputs))), targets);
    dense_loss.backward();
    dense_optimizer.step();

    parallel_optimizer.zero_grad();
    const torch::Tensor parallel_loss = torch::mse_loss(row(torch::gelu(column(inputs))), targets);
    parallel_loss.backward();
    parallel_optimizer.step();

    const double loss_diff = std::abs(dense_loss.item<double>() - parallel_loss.item<double>());
    worst = std::max(worst, loss_diff);
    if (is_rank0) {
      std::printf("step %d  dense loss %.6f  parallel loss %.6f  |difference| %.2e\n",
                  step,
                  dense_loss.item<double>(),
                  parallel_loss.item<double>(),
                  loss_diff);
    }
  }

  // to_dense is a collective: every rank gathers the trained shards.
  const torch::nn::Linear gathered_first = column->to_dense();
  const torch::nn::Linear gathered_second = row->to_dense();
  const double weight_diff = std::max({max_abs_diff(gathered_first->weight, dense_first->weight),
                                       max_abs_diff(gathered_first->bias, dense_first->bias),
                                       max_abs_diff(gathered_second->weight, dense_second->weight),
                                       max_abs_diff(gathered_second->bias, dense_second->bias)});
  worst = std::max(worst, weight_diff);
  const bool ok = worst <= kTolerance;
  if (is_rank0) {
    std::printf("trained weights: max |parallel - dense| = %.2e\n", weight_diff);
    std::printf(
        "%s: largest difference %.2e, tolerance %.0e\n", ok ? "OK" : "FAILED", worst, kTolerance);
  }
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const c10::Error& e) {
    std::fprintf(stderr,
                 "tp_mlp (RANK=%s): %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "tp_mlp (RANK=%s): %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what());
  }
  return EXIT_FAILURE;
}
