#pragma once
// A small GPT (torch_mp::models, what the C++ examples tp_gpt.cpp and gpt_3d.cpp train): the
// one-process model (DenseGpt) and its tensor-parallel pipeline stages (GptStage), sharded from
// it. It is the C++ twin of torch_mp.models.gpt: the same model, corpus and batches, and the same
// parameter names (tok, pos, layers.<i>.*, norm), so a checkpoint either front end saves, the other
// loads.
//
// The model: token and learned position embeddings, pre-LN transformer layers without biases
// (initialised as GPT-2's: gpt2_init_std) under a causal mask (torch_mp::dense::TransformerLayer:
// LibTorch's layers have no pre-LN or bias switch), a final LayerNorm and an output head tied to
// the token embedding, on [b, s] token ids, giving [s, b, vocab] logits.
//
// In the stages, the vocabulary (embedding rows, logits, loss), the attention heads and the MLP
// are split across the tensor group; with sequence parallelism the LayerNorms and residuals act
// on each rank's chunk of the sequence. With a context group each of its ranks holds its part of
// every sequence (load-balanced, context_parallel::shard_sequence) from the embeddings to the
// loss, the mean over the whole sequence. The first stage holds the embeddings, the last the final
// norm and the head: a copy of the embedding tied to it across the pipeline (or the embedding
// itself when one stage holds both).
//
// With Config::moe_experts every layer's MLP is a mixture of experts (DenseMoeLayer,
// torch_mp::dense::MoE), its experts spread over the mesh's expert group in the stages
// (ParallelMoeLayer, torch_mp::moe::MoE); the layers' load-balancing losses travel with the
// activations from stage to stage and join the loss at the end (torch_mp.models.gpt's MoELayer
// and ParallelMoELayer).

#include <torch/torch.h>
#include <torch_mp/torch_mp.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace torch_mp::models {

namespace tp = torch_mp::tensor_parallel;

/// The GPT's sizes. heads and ffn (and seq under sequence parallelism) must be divisible by the
/// tensor-parallel size; the vocabulary need not be. With moe_experts every layer is a
/// DenseMoeLayer of that many experts of ffn each, moe_top_k of them per token.
struct Config {
  int64_t vocab = 0;
  int64_t seq = 32, hidden = 32, heads = 4, ffn = 64, layers = 4;
  int64_t moe_experts = 0, moe_top_k = 2;
};

/// The corpus the examples train on (from the repository's root): Shakespeare's plays, public
/// domain, shipped with the Python package.
constexpr const char* kShakespeare = "torch_mp/models/data/shakespeare.txt";

/// The bytes of a text file as token ids (its distinct bytes, in order, numbered from 0), cut
/// into random windows, the same on every rank for the same step: torch_mp.models.Corpus's.
class Corpus {
 public:
  explicit Corpus(const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
      throw std::runtime_error("torch_mp::models::Corpus: cannot read " + path +
                               " (run from the repository root)");
    }
    const std::string text{std::istreambuf_iterator<char>(file), {}};
    const std::set<unsigned char> alphabet(text.begin(), text.end());
    std::vector<int64_t> index(256, -1);
    for (unsigned char c : alphabet) {
      index[c] = vocab++;
      bytes.push_back(static_cast<char>(c));
    }
    std::vector<int64_t> data;
    data.reserve(text.size());
    for (unsigned char c : text) {
      data.push_back(index[c]);
    }
    ids = torch::tensor(data, torch::kLong);
  }

  /// `batch` windows for `step`: inputs and next-token targets, each [batch, seq].
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int64_t batch, int64_t seq) const {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
    const auto starts = torch::randint(ids.size(0) - seq - 1, {batch}, generator, torch::kLong);
    std::vector<torch::Tensor> windows;
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t start = starts[i].item<int64_t>();
      windows.push_back(ids.slice(0, start, start + seq + 1));
    }
    const auto all = torch::stack(windows);
    return {all.slice(1, 0, seq), all.slice(1, 1, seq + 1)};
  }

  /// Token ids back to text.
  std::string decode(const torch::Tensor& tokens) const {
    std::string text;
    for (int64_t i = 0; i < tokens.numel(); ++i) {
      text += bytes.at(tokens[i].item<int64_t>());
    }
    return text;
  }

  torch::Tensor ids;
  int64_t vocab = 0;
  std::string bytes;  // the byte of each token id
};

/// GPT-2's initial standard deviation of the parameter `name` of a `layers`-layer DenseGpt: 0.02
/// for the tables and projections, 0.02 / sqrt(2 * layers) for the projections that end a
/// residual branch (self_attn.out_proj, linear2 or the experts' moe.experts.fc2_weight), none for
/// the LayerNorms (weight 1, bias 0).
/// torch_mp.models.gpt.gpt2_init_std's twin.
inline std::optional<double> gpt2_init_std(const std::string& name, int64_t layers) {
  constexpr double kStd = 0.02;
  const auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name.find("norm") != std::string::npos) {
    return std::nullopt;
  }
  if (ends_with("self_attn.out_proj.weight") || ends_with("linear2.weight") ||
      ends_with("experts.fc2_weight")) {
    return kStd / std::sqrt(2.0 * static_cast<double>(layers));
  }
  return kStd;
}

/// [s, s]: -inf above the diagonal.
inline torch::Tensor causal_mask(int64_t s) {
  return torch::full({s, s}, -std::numeric_limits<float>::infinity()).triu(1);
}

/// A pre-LN transformer layer whose MLP is a mixture of experts, without biases:
/// x + attn(norm1(x)), then + moe(norm2(x)) (gelu experts, softmax router). forward returns
/// (x, aux_loss): the load-balancing loss of the layer's s * b tokens.
struct DenseMoeLayerImpl : torch::nn::Module {
  explicit DenseMoeLayerImpl(const Config& c) {
    self_attn =
        register_module("self_attn",
                        torch::nn::MultiheadAttention(
                            torch::nn::MultiheadAttentionOptions(c.hidden, c.heads).bias(false)));
    norm1 = register_module(
        "norm1",
        torch_mp::dense::LayerNorm(torch_mp::dense::LayerNormOptions(c.hidden).bias(false)));
    norm2 = register_module(
        "norm2",
        torch_mp::dense::LayerNorm(torch_mp::dense::LayerNormOptions(c.hidden).bias(false)));
    moe = register_module(
        "moe",
        torch_mp::dense::MoE(
            torch_mp::dense::MoEOptions(c.hidden, c.ffn, c.moe_experts).top_k(c.moe_top_k)));
  }

  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& input,
                                                   const torch::Tensor& mask) {
    const auto h = norm1(input);
    const auto x = input + std::get<0>(self_attn->forward(h, h, h, {}, false, mask));
    const auto [y, aux_loss] = moe(norm2(x));
    return {x + y, aux_loss};
  }

  torch::nn::MultiheadAttention self_attn = nullptr;
  torch_mp::dense::LayerNorm norm1 = nullptr, norm2 = nullptr;
  torch_mp::dense::MoE moe = nullptr;
};
TORCH_MODULE(DenseMoeLayer);

/// The one-process model, on [b, s] token ids; returns [s, b, vocab] logits (forward_with_aux:
/// and the sum of the MoE layers' load-balancing losses, 0 without them).
struct DenseGptImpl : torch::nn::Module {
  explicit DenseGptImpl(const Config& config) : config(config) {
    tok = register_module("tok", torch::nn::Embedding(config.vocab, config.hidden));
    pos = register_module("pos", torch::nn::Embedding(config.seq, config.hidden));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < config.layers; ++i) {
      if (config.moe_experts > 0) {
        layers->push_back(DenseMoeLayer(config));
        continue;
      }
      layers->push_back(torch_mp::dense::TransformerLayer(
          torch_mp::dense::TransformerLayerOptions(config.hidden, config.heads, config.ffn)
              .dropout(0.0)
              .activation("gelu")
              .norm_first(true)
              .bias(false)));
    }
    norm = register_module("norm", torch_mp::dense::LayerNorm(config.hidden));
    torch::NoGradGuard no_grad;  // GPT-2's initialisation
    for (auto& item : named_parameters()) {
      if (const auto std = gpt2_init_std(item.key(), config.layers)) {
        item.value().normal_(0.0, *std);
      }
    }
  }

  torch::Tensor forward(const torch::Tensor& tokens) {
    return std::get<0>(forward_with_aux(tokens));
  }

  std::tuple<torch::Tensor, torch::Tensor> forward_with_aux(const torch::Tensor& tokens) {
    const auto t = tokens.t();  // [s, b]
    const int64_t s = t.size(0);
    auto x = tok(t) + pos(torch::arange(s)).unsqueeze(1);
    const auto mask = causal_mask(s);
    auto aux_loss = torch::zeros({});
    for (const auto& layer : *layers) {
      if (auto* moe = layer->as<DenseMoeLayerImpl>()) {
        auto [y, layer_aux] = moe->forward(x, mask);
        x = y;
        aux_loss = aux_loss + layer_aux;
      } else {
        x = layer->as<torch_mp::dense::TransformerLayerImpl>()->forward(x, mask);
      }
    }
    return {torch::matmul(norm(x), tok->weight.t()), aux_loss};
  }

  /// The layer `i` (for from_dense).
  torch_mp::dense::TransformerLayer layer(int64_t i) const {
    return torch_mp::dense::TransformerLayer(layers->ptr<torch_mp::dense::TransformerLayerImpl>(i));
  }
  /// The MoE layer `i`.
  DenseMoeLayer moe_layer(int64_t i) const {
    return DenseMoeLayer(layers->ptr<DenseMoeLayerImpl>(i));
  }

  Config config;
  torch::nn::Embedding tok = nullptr;
  torch::nn::Embedding pos = nullptr;
  torch::nn::ModuleList layers = nullptr;
  torch_mp::dense::LayerNorm norm = nullptr;
};
TORCH_MODULE(DenseGpt);

/// `prompt` ([b, s0] token ids) continued by `length` tokens, each drawn from the softmax of the
/// model's last logits divided by `temperature` (the most likely token when it is 0), the model
/// seeing the last config.seq tokens: torch_mp.models.sample's twin. Returns [b, s0 + length].
inline torch::Tensor sample(DenseGpt& model,
                            const torch::Tensor& prompt,
                            int64_t length,
                            double temperature,
                            std::optional<at::Generator> generator = std::nullopt) {
  torch::NoGradGuard no_grad;
  auto ids = prompt;
  for (int64_t i = 0; i < length; ++i) {
    const int64_t s = std::min<int64_t>(ids.size(1), model->config.seq);
    const auto logits = model->forward(ids.slice(1, ids.size(1) - s))[-1];  // [b, vocab]
    const auto token =
        temperature == 0.0
            ? logits.argmax(-1)
            : torch::multinomial(torch::softmax(logits / temperature, -1), 1, false, generator)
                  .select(1, 0);
    ids = torch::cat({ids, token.unsqueeze(1)}, 1);
  }
  return ids;
}

/// Cross-entropy of [s, b, vocab] logits against [b, s] next-token targets.
inline torch::Tensor dense_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).flatten(0, 1),
                                              target.t().flatten());
}

/// DenseMoeLayer sharded: the attention heads over the tensor group (ParallelSelfAttention), the
/// experts over the expert group (torch_mp::moe::MoE). Every rank of the tensor group runs the
/// mixture on the whole [s, b, h] (the same tokens, the same experts), so its parameters are
/// replicated over the tensor group and their gradients are the dense ones on each rank.
struct ParallelMoeLayerImpl : torch::nn::Module {
  ParallelMoeLayerImpl(const DenseMoeLayer& dense,
                       torch_mp::GroupPtr group,
                       torch_mp::GroupPtr expert_group)
      : group(std::move(group)) {
    const auto& attention = dense->self_attn->options;
    self_attn = register_module(
        "self_attn",
        tp::ParallelSelfAttentionImpl::from_dense(
            dense->self_attn,
            tp::ParallelSelfAttentionOptions(attention.embed_dim(), attention.num_heads())
                .bias(false)
                .group(this->group)));
    norm1 = register_module("norm1", copy_norm(dense->norm1));
    norm2 = register_module("norm2", copy_norm(dense->norm2));
    moe = register_module("moe",
                          torch_mp::moe::MoEImpl::from_dense(dense->moe, std::move(expert_group)));
  }

  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& input) {
    const auto x = input + self_attn->forward(normed(norm1, input), {}, /*is_causal=*/true);
    const auto [y, aux_loss] = moe->forward(normed(norm2, x));
    return {x + y, aux_loss};
  }

  torch::Tensor normed(const torch_mp::dense::LayerNorm& norm, const torch::Tensor& x) const {
    return tp::layer_norm(x, norm->weight, norm->bias, norm->options.eps(), false, group);
  }

  static torch_mp::dense::LayerNorm copy_norm(const torch_mp::dense::LayerNorm& dense) {
    torch_mp::dense::LayerNorm norm(dense->options);
    torch::NoGradGuard no_grad;
    norm->weight.copy_(dense->weight);
    return norm;
  }

  torch_mp::GroupPtr group;
  tp::ParallelSelfAttention self_attn = nullptr;
  torch_mp::dense::LayerNorm norm1 = nullptr, norm2 = nullptr;
  torch_mp::moe::MoE moe = nullptr;
};
TORCH_MODULE(ParallelMoeLayer);

/// One pipeline stage of DenseGpt, tensor-parallel: layers [first_layer, first_layer + count),
/// plus the embeddings on the first stage and the final norm and (tied) head on the last. The
/// first stage takes [b, s] token ids; stages pass [s, b, h] activations ([s / t, b, h] under
/// sequence parallelism); the last returns this rank's [s, b, ceil(vocab / t)] slice of the
/// logits, for loss(). With a `context_group` the first stage keeps this rank's part of the
/// tokens and positions (s above is the part's s / cp), the layers' attention meets the other
/// parts by `context_method`, and loss() takes the whole targets and keeps the same part.
///
/// With MoE layers (Config::moe_experts; their experts over `expert_group`, the default mesh's
/// ep_group when null) every stage also passes on the sum of the load-balancing losses so far, a
/// scalar: forward_all takes and returns {x, aux_loss} ({tokens} into the first stage), and
/// loss() adds it. Sequence and context parallelism and recomputation are refused with them.
struct GptStageImpl : torch::nn::Module {
  GptStageImpl(const DenseGpt& dense,
               int64_t first_layer,
               int64_t count,
               bool first,
               bool last,
               bool sequence_parallel,
               torch_mp::GroupPtr group,
               const std::string& recompute = "",
               torch_mp::GroupPtr context_group = nullptr,
               const std::string& context_method = "ring",
               torch_mp::GroupPtr expert_group = nullptr)
      : first(first),
        last(last),
        sequence_parallel(sequence_parallel),
        moe(dense->config.moe_experts > 0),
        first_layer(first_layer),
        vocab(dense->config.vocab),
        group(std::move(group)),
        context_group(std::move(context_group)) {
    if (moe && (sequence_parallel || this->context_group || !recompute.empty())) {
      throw std::invalid_argument(
          "GptStage: MoE layers do not support sequence parallelism, context parallelism or "
          "recomputation yet");
    }
    if (first) {
      tok = register_module("tok",
                            tp::VocabParallelEmbeddingImpl::from_dense(dense->tok, this->group));
      pos = register_module("pos",
                            torch::nn::Embedding::from_pretrained(
                                dense->pos->weight.detach().clone(),
                                torch::nn::EmbeddingFromPretrainedOptions().freeze(false)));
    }
    layers = register_module("layers", torch::nn::ModuleList());
    const auto& c = dense->config;
    const auto options = tp::ParallelTransformerLayerOptions(c.hidden, c.heads, c.ffn)
                             .sequence_parallel(sequence_parallel)
                             .recompute(recompute)
                             .group(this->group)
                             .context_parallel(this->context_group != nullptr)
                             .context_group(this->context_group)
                             .context_method(context_method);
    for (int64_t i = first_layer; i < first_layer + count; ++i) {
      if (moe) {
        layers->push_back(ParallelMoeLayer(dense->moe_layer(i), this->group, expert_group));
      } else {
        layers->push_back(tp::ParallelTransformerLayerImpl::from_dense(dense->layer(i), options));
      }
    }
    if (last) {
      norm = register_module("norm", torch_mp::dense::LayerNorm(dense->norm->options));
      torch::NoGradGuard no_grad;
      norm->weight.copy_(dense->norm->weight);
      norm->bias.copy_(dense->norm->bias);
      // One stage holds both ends: the head is the embedding itself. Otherwise a copy, tied to
      // the first stage's through Pipeline::tie_parameters.
      head = first
                 ? tok
                 : register_module(
                       "head", tp::VocabParallelEmbeddingImpl::from_dense(dense->tok, this->group));
    }
  }

  /// Without MoE layers: [b, s] tokens or [s, b, h] in, one tensor out.
  torch::Tensor forward(const torch::Tensor& input) {
    TORCH_CHECK(!moe, "GptStage: a stage with MoE layers runs through forward_all");
    return forward_all({input})[0];
  }

  /// The stage on its inputs ({tokens} or {x}, with MoE layers {x, aux_loss} after the first):
  /// {x}, or {x, aux_loss} with MoE layers.
  std::vector<torch::Tensor> forward_all(const std::vector<torch::Tensor>& inputs) {
    auto x = inputs.at(0);
    // (One element, not a scalar: the pipeline joins micro-batches' outputs by concatenation.)
    auto aux_loss = moe ? (first ? torch::zeros({1}) : inputs.at(1)) : torch::Tensor();
    if (first) {
      auto tokens = x.t();
      auto positions = torch::arange(tokens.size(0));
      if (context_group) {  // this rank's part of the sequence, from here to the loss
        positions = torch_mp::context_parallel::sequence_positions(
            tokens.size(0), context_group->getRank(), context_group->getSize());
        tokens = torch_mp::context_parallel::shard_sequence(tokens, 0, context_group);
      }
      // Every rank computes the whole embedding (the vocab-parallel lookup all-reduces).
      x = tok(tokens) + pos(positions).unsqueeze(1);
      if (sequence_parallel) {
        // This rank's chunk of the sequence; scatter_to_tp gives the tables the whole
        // sequence's gradient (its backward all-gathers).
        x = torch_mp::scatter_to_tp(x, group, 0);
      }
    }
    for (const auto& layer : *layers) {
      if (moe) {
        auto [y, layer_aux] = layer->as<ParallelMoeLayerImpl>()->forward(x);
        x = y;
        aux_loss = aux_loss + layer_aux;
      } else {
        x = layer->as<tp::ParallelTransformerLayerImpl>()->forward(x, {}, /*is_causal=*/true);
      }
    }
    if (last) {
      auto h = tp::layer_norm(
          x, norm->weight, norm->bias, norm->options.eps(), sequence_parallel, group);
      // Into the vocab-parallel head: under sequence parallelism gather the sequence back
      // (backward reduce-scatters), otherwise copy_to_tp (backward all-reduces).
      h = sequence_parallel ? torch_mp::gather_from_sp(h, group, 0)
                            : torch_mp::copy_to_tp(h, group);
      x = torch::matmul(h, head->weight.t());
    }
    return moe ? std::vector<torch::Tensor>{x, aux_loss} : std::vector<torch::Tensor>{x};
  }

  /// The last stage's loss of its outputs (forward_all's: logits, and with MoE layers the
  /// load-balancing losses, added).
  torch::Tensor loss(const std::vector<torch::Tensor>& outputs, const torch::Tensor& target) const {
    const auto ce = cross_entropy(outputs.at(0), target);
    return moe ? ce + outputs.at(1).to(torch::kFloat).sum() : ce;
  }

  /// The last stage's loss without MoE layers (with them: loss(outputs, target)).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& target) const {
    TORCH_CHECK(!moe, "GptStage::loss: with MoE layers pass forward_all's outputs (the aux loss)");
    return cross_entropy(logits, target);
  }

  /// Vocabulary-parallel cross-entropy against [b, s] targets (under context parallelism this
  /// rank's part of them, the mean over the context group's tokens).
  torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) const {
    auto mine = target.t();
    if (context_group) {
      mine = torch_mp::context_parallel::shard_sequence(mine, 0, context_group);
    }
    return tp::vocab_parallel_cross_entropy(logits.to(torch::kFloat),
                                            mine,
                                            group,
                                            -100,
                                            0.0,
                                            at::Reduction::Mean,
                                            vocab,
                                            context_group);
  }

  /// How this stage's names map to DenseGpt's, for torch_mp::checkpoint: its layers renumbered,
  /// and the head, tied to the embedding, to the embedding's name.
  torch_mp::checkpoint::Rename dense_names() const {
    torch_mp::checkpoint::Rename names{{"head.weight", "tok.weight"}};
    for (size_t j = 0; j < layers->size(); ++j) {
      names.emplace_back("layers." + std::to_string(j) + ".",
                         "layers." + std::to_string(first_layer + j) + ".");
    }
    return names;
  }

  bool first, last, sequence_parallel, moe;
  int64_t first_layer, vocab;
  torch_mp::GroupPtr group, context_group;
  tp::VocabParallelEmbedding tok = nullptr, head = nullptr;
  torch::nn::Embedding pos = nullptr;
  torch::nn::ModuleList layers = nullptr;
  torch_mp::dense::LayerNorm norm = nullptr;
};
TORCH_MODULE(GptStage);

}  // namespace torch_mp::models
