#pragma once
// Dense (one-process) modules that the tensor-parallel blocks shard with from_dense, where
// LibTorch has none: the C++ twins of torch_mp.dense.MLP and ConvBlock (the twins of its Experts
// and MoE are the MoE area's: moe/dense_moe.h), and of
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

}  // namespace torch_mp::dense
