// Trains a small tensor-parallel GPT next to its dense twin and checks that they stay equal: the
// C++ counterpart of examples/python/tp_gpt.py.
//
//   torchrun --standalone --no-python --nproc-per-node=2 build/examples/cpp/tp_gpt
//
// The model is torch_mp/models/gpt.h's (torch_mp.models.gpt's twin): token and learned position
// embeddings, pre-LN transformer layers under a causal mask, a final LayerNorm and an output head
// tied to the token embedding, here with a vocabulary of 1001 (which 2 and 4 do not divide) on
// random tokens. In the parallel copy (one GptStage holding the whole model) the vocabulary is
// split (and padded), the heads and the MLP are split in each layer, and the loss is
// vocab_parallel_cross_entropy (the logits are never gathered). Rank 0 prints both losses per
// step; the exit status is non-zero if they drift apart.

#include <torch/torch.h>
#include <torch_mp/models/gpt.h>
#include <torch_mp/torch_mp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

namespace {

namespace gpt = torch_mp::models;

constexpr int64_t kBatch = 4;
constexpr int kSteps = 5;
constexpr double kLearningRate = 0.5;
constexpr double kTolerance = 1e-5;

int64_t world_size_from_env() {
  const char* value = std::getenv("WORLD_SIZE");
  if (value == nullptr || *value == '\0') {
    throw std::runtime_error(
        "WORLD_SIZE is not set: run this program with torchrun "
        "(torchrun --standalone --no-python --nproc-per-node=2 tp_gpt)");
  }
  return std::stoll(value);
}

int run() {
  const int64_t world_size = world_size_from_env();
  auto mesh =
      torch_mp::init(torch_mp::InitOptions().tp(world_size).timeout(std::chrono::seconds(60)));
  const bool is_rank0 = mesh->rank == 0;

  torch::manual_seed(0);  // the same dense model and data on every rank
  const gpt::Config config{.vocab = 1001, .seq = 16, .layers = 2};
  gpt::DenseGpt dense(config);
  gpt::GptStage parallel(dense, 0, config.layers, true, true, false, mesh->tp_group);
  const auto tokens = torch::randint(0, config.vocab, {kBatch, config.seq + 1});
  const auto inputs = tokens.slice(1, 0, config.seq);
  const auto targets = tokens.slice(1, 1, config.seq + 1);  // the next token

  torch::optim::SGD dense_optimizer(dense->parameters(), kLearningRate);
  torch::optim::SGD parallel_optimizer(parallel->parameters(), kLearningRate);
  if (is_rank0) {
    const auto range = torch_mp::tensor_parallel::vocab_range(config.vocab, mesh->tp_group);
    std::printf("tp_gpt: %lld rank(s); vocabulary %lld padded to %lld (%lld rows per rank)\n",
                static_cast<long long>(world_size),
                static_cast<long long>(config.vocab),
                static_cast<long long>(range.rows * world_size),
                static_cast<long long>(range.rows));
  }
  double worst = 0.0;
  for (int step = 1; step <= kSteps; ++step) {
    dense_optimizer.zero_grad();
    const auto dense_loss = gpt::dense_loss(dense->forward(inputs), targets);
    dense_loss.backward();
    dense_optimizer.step();

    parallel_optimizer.zero_grad();
    const auto parallel_loss = parallel->loss(parallel->forward(inputs), targets);
    parallel_loss.backward();
    parallel_optimizer.step();

    const double difference = std::abs(dense_loss.item<double>() - parallel_loss.item<double>());
    worst = std::max(worst, difference);
    if (is_rank0) {
      std::printf("step %d  dense loss %.6f  parallel loss %.6f  |difference| %.2e\n",
                  step,
                  dense_loss.item<double>(),
                  parallel_loss.item<double>(),
                  difference);
    }
  }
  // to_dense is a collective: the trained vocabulary shards, gathered.
  const double table_diff =
      (parallel->tok->to_dense()->weight - dense->tok->weight).abs().max().item<double>();
  worst = std::max(worst, table_diff);
  const bool ok = worst <= kTolerance;
  if (is_rank0) {
    std::printf("trained token embedding: max |parallel - dense| = %.2e\n", table_diff);
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
                 "tp_gpt (RANK=%s): %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "tp_gpt (RANK=%s): %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what());
  }
  return EXIT_FAILURE;
}
