// Trains a small tensor-parallel GPT-style model next to its dense twin and checks that they stay
// equal: the C++ counterpart of examples/python/tp_gpt.py.
//
//   torchrun --standalone --no-python --nproc-per-node=2 build/examples/cpp/tp_gpt
//
// Dense model (the same on every rank, from one seed): token embedding (a vocabulary of 1001,
// which 2 and 4 do not divide), learned positions, two torch::nn::TransformerEncoderLayers under
// a causal mask, and an output head tied to the token embedding, trained with cross-entropy.
// Parallel model, sharded from it: VocabParallelEmbedding (padded vocabulary),
// ParallelTransformerLayer (heads and MLP split), the tied head computing this rank's vocabulary
// slice of the logits, and vocab_parallel_cross_entropy (the logits are never gathered).
// Rank 0 prints both losses per step; the exit status is non-zero if they drift apart.

#include <torch/torch.h>
#include <torch_mp/torch_mp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace tp = torch_mp::tensor_parallel;

constexpr int64_t kVocab = 1001;
constexpr int64_t kSeq = 16;
constexpr int64_t kBatch = 4;
constexpr int64_t kHidden = 32;
constexpr int64_t kHeads = 4;
constexpr int64_t kFfn = 64;
constexpr int kLayers = 2;
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

/// The dense model: every rank builds the same one from the same seed.
struct DenseGpt : torch::nn::Module {
  DenseGpt() {
    tok = register_module("tok", torch::nn::Embedding(kVocab, kHidden));
    pos = register_module("pos", torch::nn::Embedding(kSeq, kHidden));
    for (int i = 0; i < kLayers; ++i) {
      layers.push_back(
          register_module("layer" + std::to_string(i),
                          torch::nn::TransformerEncoderLayer(
                              torch::nn::TransformerEncoderLayerOptions(kHidden, kHeads)
                                  .dim_feedforward(kFfn)
                                  .dropout(0.0)
                                  .activation(torch::kGELU))));
    }
    torch::NoGradGuard no_grad;
    tok->weight.mul_(0.02);  // a first loss near ln(vocabulary)
  }

  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& mask) {
    auto x = tok(tokens) + pos(torch::arange(kSeq)).unsqueeze(1);  // [s, b, h]
    for (auto& layer : layers) {
      x = layer(x, mask);
    }
    return torch::matmul(x, tok->weight.t());  // [s, b, vocab]
  }

  torch::nn::Embedding tok = nullptr;
  torch::nn::Embedding pos = nullptr;
  std::vector<torch::nn::TransformerEncoderLayer> layers;
};

/// The dense model sharded over `group`: returns this rank's vocabulary slice of the logits.
struct ParallelGpt : torch::nn::Module {
  ParallelGpt(const DenseGpt& dense, const torch_mp::GroupPtr& group) : group(group) {
    tok = register_module("tok", tp::VocabParallelEmbeddingImpl::from_dense(dense.tok, group));
    pos = register_module(
        "pos",
        torch::nn::Embedding::from_pretrained(
            dense.pos->weight.detach().clone(),
            torch::nn::EmbeddingFromPretrainedOptions().freeze(false)));  // replicated
    for (size_t i = 0; i < dense.layers.size(); ++i) {
      layers.push_back(
          register_module("layer" + std::to_string(i),
                          tp::ParallelTransformerLayerImpl::from_dense(dense.layers[i], group)));
    }
  }

  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& mask) {
    auto x = tok(tokens) + pos(torch::arange(kSeq)).unsqueeze(1);
    for (auto& layer : layers) {
      x = layer(x, mask);
    }
    // Into the vocabulary-parallel head: backward all-reduces the hidden states' gradient.
    return torch::matmul(torch_mp::copy_to_tp(x, group), tok->weight.t());
  }

  torch_mp::GroupPtr group;
  tp::VocabParallelEmbedding tok = nullptr;
  torch::nn::Embedding pos = nullptr;
  std::vector<tp::ParallelTransformerLayer> layers;
};

int run() {
  const int64_t world_size = world_size_from_env();
  auto mesh =
      torch_mp::init(torch_mp::InitOptions().tp(world_size).timeout(std::chrono::seconds(60)));
  const bool is_rank0 = mesh->rank == 0;

  torch::manual_seed(0);
  DenseGpt dense;
  ParallelGpt parallel(dense, mesh->tp_group);
  const auto tokens = torch::randint(0, kVocab, {kSeq + 1, kBatch});
  const auto inputs = tokens.slice(0, 0, kSeq);
  const auto targets = tokens.slice(0, 1, kSeq + 1);
  const auto mask =
      torch::full({kSeq, kSeq}, -std::numeric_limits<float>::infinity()).triu(1);  // causal

  torch::optim::SGD dense_optimizer(dense.parameters(), kLearningRate);
  torch::optim::SGD parallel_optimizer(parallel.parameters(), kLearningRate);
  if (is_rank0) {
    const auto range = tp::vocab_range(kVocab, mesh->tp_group);
    std::printf("tp_gpt: %lld rank(s); vocabulary %lld padded to %lld (%lld rows per rank)\n",
                static_cast<long long>(world_size),
                static_cast<long long>(kVocab),
                static_cast<long long>(range.rows * world_size),
                static_cast<long long>(range.rows));
  }
  double worst = 0.0;
  for (int step = 1; step <= kSteps; ++step) {
    dense_optimizer.zero_grad();
    const auto dense_loss = torch::nn::functional::cross_entropy(
        dense.forward(inputs, mask).reshape({-1, kVocab}), targets.reshape({-1}));
    dense_loss.backward();
    dense_optimizer.step();

    parallel_optimizer.zero_grad();
    const auto parallel_loss = tp::vocab_parallel_cross_entropy(parallel.forward(inputs, mask),
                                                                targets,
                                                                mesh->tp_group,
                                                                -100,
                                                                0.0,
                                                                at::Reduction::Mean,
                                                                kVocab);
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
      (parallel.tok->to_dense()->weight - dense.tok->weight).abs().max().item<double>();
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
