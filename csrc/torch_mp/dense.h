#pragma once
// Dense (one-process) modules that the tensor-parallel blocks shard with from_dense, where
// LibTorch has none: the C++ twins of torch_mp.dense.MLP, ConvBlock, Experts and MoE, and of
// the PyTorch modules LibTorch's lack options of (torch.nn.LayerNorm's bias,
// torch.nn.TransformerEncoderLayer's norm_first and bias), with PyTorch's parameter names, so
// that a C++ model and its Python twin share checkpoints.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <tuple>

#include "torch_mp/options.h"

namespace torch_mp::dense {

/// Options of MLP.
struct MLPOptions {
  MLPOptions(int64_t hidden_size, int64_t ffn_hidden_size)
      : hidden_size_(hidden_size), ffn_hidden_size_(ffn_hidden_size) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, ffn_hidden_size);
  TORCH_ARG(bool, bias) = true;
  /// "gelu" or "relu".
  TORCH_ARG(std::string, activation) = "gelu";
  /// Dropout after the activation (in training).
  TORCH_ARG(double, dropout) = 0.0;
};

/// fc2(dropout(activation(fc1(x)))) with fc1: hidden -> ffn and fc2: ffn -> hidden.
class MLPImpl : public torch::nn::Cloneable<MLPImpl> {
 public:
  MLPImpl(int64_t hidden_size, int64_t ffn_hidden_size)
      : MLPImpl(MLPOptions(hidden_size, ffn_hidden_size)) {}
  explicit MLPImpl(MLPOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  MLPOptions options;
  torch::nn::Linear fc1 = nullptr;
  torch::nn::Linear fc2 = nullptr;
};
TORCH_MODULE(MLP);

/// Options of ConvBlock.
struct ConvBlockOptions {
  ConvBlockOptions(int64_t in_channels,
                   int64_t mid_channels,
                   int64_t out_channels,
                   int64_t kernel_size = 3)
      : in_channels_(in_channels),
        mid_channels_(mid_channels),
        out_channels_(out_channels),
        kernel_size_(kernel_size) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, mid_channels);
  TORCH_ARG(int64_t, out_channels);
  TORCH_ARG(int64_t, kernel_size);
  /// Padding of both convolutions (default: kernel_size / 2).
  TORCH_ARG(std::optional<int64_t>, padding) = std::nullopt;
  TORCH_ARG(bool, bias) = true;
};

/// conv2(relu(norm(conv1(x)))): Conv2d (in -> mid), BatchNorm2d, ReLU, Conv2d (mid -> out).
class ConvBlockImpl : public torch::nn::Cloneable<ConvBlockImpl> {
 public:
  explicit ConvBlockImpl(ConvBlockOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  ConvBlockOptions options;
  torch::nn::Conv2d conv1 = nullptr;
  torch::nn::BatchNorm2d norm = nullptr;
  torch::nn::Conv2d conv2 = nullptr;
};
TORCH_MODULE(ConvBlock);

/// Options of LayerNorm.
struct LayerNormOptions {
  /* implicit */ LayerNormOptions(int64_t hidden_size) : hidden_size_(hidden_size) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(double, eps) = 1e-5;
  /// A learned bias besides the weight.
  TORCH_ARG(bool, bias) = true;
};

/// torch.nn.LayerNorm over the last dimension: a weight (ones) and, with options.bias(), a bias
/// (zeros; undefined without).
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl> {
 public:
  explicit LayerNormImpl(LayerNormOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  LayerNormOptions options;
  at::Tensor weight;
  at::Tensor bias;
};
TORCH_MODULE(LayerNorm);

/// Options of TransformerLayer (defaults as torch.nn.TransformerEncoderLayer's).
struct TransformerLayerOptions {
  TransformerLayerOptions(int64_t hidden_size, int64_t num_heads, int64_t ffn_hidden_size)
      : hidden_size_(hidden_size), num_heads_(num_heads), ffn_hidden_size_(ffn_hidden_size) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, num_heads);
  TORCH_ARG(int64_t, ffn_hidden_size);
  TORCH_ARG(double, dropout) = 0.1;
  /// "relu" or "gelu".
  TORCH_ARG(std::string, activation) = "relu";
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  /// Pre-LN (x + f(norm(x))) instead of post-LN (norm(x + f(x))).
  TORCH_ARG(bool, norm_first) = false;
  /// Biases of the projections and the LayerNorms.
  TORCH_ARG(bool, bias) = true;
};

/// torch.nn.TransformerEncoderLayer on [s, b, h], with its parameter names (self_attn.in_proj_*,
/// self_attn.out_proj, linear1, linear2, norm1, norm2) and its draws of the initial weights.
class TransformerLayerImpl : public torch::nn::Cloneable<TransformerLayerImpl> {
 public:
  explicit TransformerLayerImpl(TransformerLayerOptions options);
  void reset() override;
  /// `attn_mask` as torch::nn::MultiheadAttention takes it (e.g. [s, s], -inf where masked).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {});

  TransformerLayerOptions options;
  torch::nn::MultiheadAttention self_attn = nullptr;
  torch::nn::Linear linear1 = nullptr;
  torch::nn::Linear linear2 = nullptr;
  LayerNorm norm1 = nullptr;
  LayerNorm norm2 = nullptr;
};
TORCH_MODULE(TransformerLayer);

/// Expert `i` of stacked expert weights (as ExpertsImpl holds them) on the rows `x` [n, hidden]:
/// fc2(activation(fc1(x))). What the dense and the expert-parallel MoE both run.
at::Tensor expert_mlp(const at::Tensor& x,
                      int64_t i,
                      const at::Tensor& fc1_weight,
                      const std::optional<at::Tensor>& fc1_bias,
                      const at::Tensor& fc2_weight,
                      const std::optional<at::Tensor>& fc2_bias,
                      const std::string& activation);

/// `num_experts` MLPs fc2(activation(fc1(x))) stacked: fc1_weight [E, ffn, hidden], fc2_weight
/// [E, hidden, ffn] (and [E, ffn], [E, hidden] biases), each expert initialised as a
/// torch::nn::Linear pair is. The experts' dim comes first, so that expert parallelism splits
/// them along it (torch_mp.dense.Experts' twin). With activation "swiglu" they are gated, as
/// Mixtral's: fc1_weight is [E, 2 ffn, hidden], the gate projection's rows then the up
/// projection's, and an expert is fc2(silu(gate(x)) * up(x)) (moe/experts.h).
class ExpertsImpl : public torch::nn::Cloneable<ExpertsImpl> {
 public:
  ExpertsImpl(int64_t hidden_size,
              int64_t ffn_hidden_size,
              int64_t num_experts,
              std::string activation = "gelu",
              bool bias = false);
  void reset() override;
  /// Each expert's pair drawn as torch::nn::Linear draws itself, expert after expert.
  void reset_parameters();
  /// Expert `i` on the rows `x` [n, hidden].
  at::Tensor expert(int64_t i, const at::Tensor& x) const;

  int64_t hidden_size, ffn_hidden_size, num_experts;
  std::string activation;
  bool bias;
  at::Tensor fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};
TORCH_MODULE(Experts);

/// The options of a mixture of experts, declared once (torch_mp/options.h); the expert-parallel
/// module's (moe/moe.h) add its group:
/// - hidden_size, ffn_hidden_size: the experts' sizes; num_experts: how many;
/// - top_k: experts per token;
/// - activation: the experts': "gelu", "relu" or the gated "swiglu" (ExpertsImpl);
/// - router: "softmax" (Mixtral's) or "sigmoid" (DeepSeek-V3's), each renormalised over the top
///   k;
/// - capacity_factor: none: dropless; else each expert takes at most
///   ceil(capacity_factor * tokens * top_k / E) tokens, the first in token order;
/// - aux_loss_coef: the load-balancing loss's coefficient;
/// - bias: biases on the experts' projections.
#define TORCH_MP_MOE_OPTIONS(REQUIRED, OPTION, KEYWORD)         \
  REQUIRED(int64_t, hidden_size)                                \
  REQUIRED(int64_t, ffn_hidden_size)                            \
  REQUIRED(int64_t, num_experts)                                \
  OPTION(int64_t, top_k, 2)                                     \
  KEYWORD(std::string, activation, "gelu")                      \
  KEYWORD(std::string, router, "softmax")                       \
  KEYWORD(std::optional<double>, capacity_factor, std::nullopt) \
  KEYWORD(double, aux_loss_coef, 0.01)                          \
  KEYWORD(bool, bias, false)

/// Options of MoE.
struct MoEOptions {
  TORCH_MP_OPTIONS(MoEOptions, TORCH_MP_MOE_OPTIONS)
};

/// Checks a one-process mixture of experts' options: the routing (moe/router.h) and the
/// experts' activation.
void check_moe(const MoEOptions& options);

/// A mixture of experts on one process (torch_mp.dense.MoE's twin; its definitions are
/// moe/router.h's): a linear router without bias picks each token's top-k experts, whose
/// outputs are summed with the routing weights. forward returns (y shaped as x, aux_loss).
class MoEImpl : public torch::nn::Cloneable<MoEImpl> {
 public:
  explicit MoEImpl(MoEOptions options);
  void reset() override;
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x);

  MoEOptions options;
  torch::nn::Linear router = nullptr;
  Experts experts = nullptr;
};
TORCH_MODULE(MoE);

}  // namespace torch_mp::dense
