#pragma once
// Tensor-parallel building blocks: self-attention (heads split), MLP, a transformer layer and a
// channel-parallel convolutional block, as functions and torch::nn modules. Each equals its
// dense counterpart (torch::nn::MultiheadAttention, two Linears,
// torch::nn::TransformerEncoderLayer, Conv2d -> BatchNorm2d -> ReLU -> Conv2d) given the same
// weights; from_dense shards one.
//
// Layout: transformer tensors are [s, b, h] (sequence first); under sequence parallelism each
// rank holds [s / t, b, h] between the blocks. Attention heads are split across ranks: rank r
// holds heads [r * n / t, (r + 1) * n / t), i.e. the matching rows of each of Q, K and V.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_mp/activation.h"
#include "torch_mp/dense.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/tensor_parallel/conv.h"
#include "torch_mp/tensor_parallel/linear.h"

namespace torch_mp::tensor_parallel {

// ---- functions --------------------------------------------------------------------------------

/// Dropout on a tensor that differs between the ranks (a shard of a tensor-parallel region, or
/// rows under sequence parallelism): drawn from the RNG tracker's per-rank model-parallel stream
/// when it is set up (torch_mp.random.manual_seed), else from the default generator.
at::Tensor region_dropout(const at::Tensor& x, double p, bool training);

/// LayerNorm over the last dim. With `sequence_parallel` the parameters (replicated on every
/// rank) enter through copy_to_tp, so their gradients are summed over the group: each rank
/// normalises its own rows, and the sum is the gradient of the dense layer.
at::Tensor layer_norm(const at::Tensor& input,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias,
                      double eps,
                      bool sequence_parallel,
                      const GroupPtr& group);

/// Scaled dot-product attention over this rank's heads: of `num_heads` in all, rank r of `group`
/// holds heads [r * n / t, (r + 1) * n / t). `qkv` [s, b, 3 * h_local] holds this rank's Q, K and
/// V columns one after the other; returns [s, b, h_local]. `attn_mask` follows
/// torch::nn::MultiheadAttention: [s, s] or [b * num_heads, s, s] (every head's; this rank uses
/// its own), bool (true = may not attend) or float (added). `is_causal` without a mask applies
/// the causal mask. Dropout (when `dropout_p` > 0) draws from the model-parallel stream of the
/// RNG tracker when it is set up.
at::Tensor attention_heads(const at::Tensor& qkv,
                           int64_t num_heads,
                           const GroupPtr& group,
                           const std::optional<at::Tensor>& attn_mask,
                           bool is_causal,
                           double dropout_p);

// Configuration checks of the blocks, shared by the C++ and Python modules. Each first compares
// the configuration across the ranks of `group` (one small all-gather; floats by their bits), so
// that a value bad on one rank raises on every rank, then checks it locally.

/// num_heads divides hidden_size and the group size divides num_heads.
void check_parallel_self_attention(int64_t hidden_size,
                                   int64_t num_heads,
                                   bool bias,
                                   double dropout,
                                   bool sequence_parallel,
                                   const GroupPtr& group);

/// A known activation ("gelu", "relu") and ffn_hidden_size divisible by the group size.
void check_parallel_mlp(int64_t hidden_size,
                        int64_t ffn_hidden_size,
                        bool bias,
                        const std::string& activation,
                        double dropout,
                        bool sequence_parallel,
                        const GroupPtr& group);

/// What a transformer layer adds to its attention's and MLP's checks.
void check_parallel_transformer_layer(bool norm_first,
                                      double layer_norm_eps,
                                      const GroupPtr& group);

/// mid_channels divisible by the group size.
void check_parallel_conv_block(int64_t in_channels,
                               int64_t mid_channels,
                               int64_t out_channels,
                               int64_t kernel_size,
                               int64_t padding,
                               bool bias,
                               const GroupPtr& group);

/// Copies this rank's heads of a dense [3h, h] in-projection (Q; K; V stacked, as in
/// torch::nn::MultiheadAttention) into `weight` [3h/t, h] (and of the [3h] bias into `bias`).
void load_dense_qkv_(at::Tensor& weight,
                     std::optional<at::Tensor> bias,
                     const at::Tensor& dense_weight,
                     const std::optional<at::Tensor>& dense_bias,
                     const GroupPtr& group);

/// The dense in-projection the ranks' QKV shards make up (a collective).
std::pair<at::Tensor, std::optional<at::Tensor>> gather_dense_qkv(
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const GroupPtr& group);

/// "relu" or "gelu" applied to `x` (torch_mp/activation.h).
using torch_mp::activation;

/// Copies this rank's channels of a dense BatchNorm2d (parameters and running statistics).
void load_dense_batch_norm_(torch::nn::BatchNorm2d& local,
                            const torch::nn::BatchNorm2d& dense,
                            const GroupPtr& group);

// ---- modules ----------------------------------------------------------------------------------

/// Options of ParallelSelfAttention.
struct ParallelSelfAttentionOptions {
  ParallelSelfAttentionOptions(int64_t hidden_size, int64_t num_heads)
      : hidden_size_(hidden_size), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, hidden_size);
  /// Attention heads in all; the group size must divide it.
  TORCH_ARG(int64_t, num_heads);
  TORCH_ARG(bool, bias) = true;
  /// Dropout on the attention probabilities (in training).
  TORCH_ARG(double, dropout) = 0.0;
  /// Input and output split along the sequence dim (0).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(GroupPtr, group) = {};
};

class ParallelSelfAttention;

/// Multi-head self-attention with the heads split across the group: a column-parallel QKV
/// projection, attention over the local heads, a row-parallel output projection.
/// (prefix of a module's own name, prefix of its dense counterpart's name) pairs.
using DenseNames = std::vector<std::pair<std::string, std::string>>;

class ParallelSelfAttentionImpl : public torch::nn::Cloneable<ParallelSelfAttentionImpl> {
 public:
  ParallelSelfAttentionImpl(int64_t hidden_size, int64_t num_heads)
      : ParallelSelfAttentionImpl(ParallelSelfAttentionOptions(hidden_size, num_heads)) {}
  explicit ParallelSelfAttentionImpl(ParallelSelfAttentionOptions options)
      : ParallelSelfAttentionImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws this rank's heads of a torch::nn::MultiheadAttention initialised as LibTorch does.
  void reset_parameters();
  /// `x` [s, b, h] ([s / t, b, h] under sequence parallelism).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {}, bool is_causal = false);
  /// Shards `dense` (embed_dim and num_heads from it; no kdim/vdim, bias_k/v or zero attention).
  static ParallelSelfAttention from_dense(const torch::nn::MultiheadAttention& dense,
                                          ParallelSelfAttentionOptions options);
  /// Allocated, not initialised (for modules that fill it).
  static ParallelSelfAttention uninitialised(ParallelSelfAttentionOptions options);
  /// Copies this rank's heads of `dense` into the parameters.
  void load_dense(const torch::nn::MultiheadAttention& dense);
  /// The dense module (a collective).
  torch::nn::MultiheadAttention to_dense() const;
  /// Parameter names in the dense module, by prefix (torch_mp::checkpoint).
  static const DenseNames& dense_names();
  /// A deep copy, its layouts recorded (Cloneable's copy replaces the children's tensors).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  ParallelSelfAttentionOptions options;
  ColumnParallelLinear qkv = nullptr;
  RowParallelLinear proj = nullptr;

 private:
  ParallelSelfAttentionImpl(ParallelSelfAttentionOptions options, bool initialise);
  void register_layouts();
  bool initialise_ = true;
};
TORCH_MODULE(ParallelSelfAttention);

/// Options of ParallelMLP.
struct ParallelMLPOptions {
  ParallelMLPOptions(int64_t hidden_size, int64_t ffn_hidden_size)
      : hidden_size_(hidden_size), ffn_hidden_size_(ffn_hidden_size) {}
  TORCH_ARG(int64_t, hidden_size);
  /// Width of the inner layer; the group size must divide it.
  TORCH_ARG(int64_t, ffn_hidden_size);
  TORCH_ARG(bool, bias) = true;
  /// "gelu" or "relu".
  TORCH_ARG(std::string, activation) = "gelu";
  /// Dropout after the activation (in training; per-rank stream, see attention_heads).
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(GroupPtr, group) = {};
};

class ParallelMLP;

/// Linear (column) -> activation -> dropout -> Linear (row).
class ParallelMLPImpl : public torch::nn::Cloneable<ParallelMLPImpl> {
 public:
  ParallelMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size)
      : ParallelMLPImpl(ParallelMLPOptions(hidden_size, ffn_hidden_size)) {}
  explicit ParallelMLPImpl(ParallelMLPOptions options)
      : ParallelMLPImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws fc1 then fc2 as two torch::nn::Linear layers would be drawn.
  void reset_parameters();
  at::Tensor forward(const at::Tensor& x);
  /// Shards the dense pair fc1 [ffn, h], fc2 [h, ffn].
  static ParallelMLP from_dense(const torch::nn::Linear& fc1,
                                const torch::nn::Linear& fc2,
                                ParallelMLPOptions options);
  /// Shards a torch_mp::dense::MLP (activation and dropout from it too).
  static ParallelMLP from_dense(const dense::MLP& mlp, ParallelMLPOptions options);
  /// Allocated, not initialised (for modules that fill it).
  static ParallelMLP uninitialised(ParallelMLPOptions options);
  /// Copies this rank's shards of the dense pair into the parameters.
  void load_dense(const torch::nn::Linear& fc1, const torch::nn::Linear& fc2);

  ParallelMLPOptions options;
  ColumnParallelLinear fc1 = nullptr;
  RowParallelLinear fc2 = nullptr;

 private:
  ParallelMLPImpl(ParallelMLPOptions options, bool initialise);
  bool initialise_ = true;
};
TORCH_MODULE(ParallelMLP);

/// Options of ParallelTransformerLayer (defaults as torch::nn::TransformerEncoderLayer's).
struct ParallelTransformerLayerOptions {
  ParallelTransformerLayerOptions(int64_t hidden_size, int64_t num_heads, int64_t ffn_hidden_size)
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
  /// Biases of the projections (LibTorch's LayerNorm has no bias switch: its bias stays).
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(GroupPtr, group) = {};
};

class ParallelTransformerLayer;

/// A transformer encoder layer (self-attention and MLP, each with a residual and LayerNorm).
class ParallelTransformerLayerImpl : public torch::nn::Cloneable<ParallelTransformerLayerImpl> {
 public:
  explicit ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options)
      : ParallelTransformerLayerImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws the weights of a torch::nn::TransformerEncoderLayer with these options and loads them.
  void reset_parameters();
  /// `x` [s, b, h] ([s / t, b, h] under sequence parallelism); mask as in attention_heads.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {}, bool is_causal = false);
  /// Shards `dense` (a post-LN layer, as LibTorch's are).
  static ParallelTransformerLayer from_dense(const torch::nn::TransformerEncoderLayer& dense,
                                             GroupPtr group = {},
                                             bool sequence_parallel = false);

  /// Copies this rank's shards of `dense` into the parameters.
  void load_dense(const torch::nn::TransformerEncoderLayer& dense);
  /// Parameter names in the dense layer, by prefix (torch_mp::checkpoint).
  static const DenseNames& dense_names();

  ParallelTransformerLayerOptions options;
  torch::nn::LayerNorm norm1 = nullptr;
  ParallelSelfAttention self_attn = nullptr;
  torch::nn::LayerNorm norm2 = nullptr;
  ParallelMLP mlp = nullptr;

 private:
  ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options, bool initialise);
  bool initialise_ = true;
  at::Tensor norm(const torch::nn::LayerNorm& layer, const at::Tensor& x);
  at::Tensor dropout(const at::Tensor& x);
};
TORCH_MODULE(ParallelTransformerLayer);

/// Options of ParallelConvBlock.
struct ParallelConvBlockOptions {
  ParallelConvBlockOptions(int64_t in_channels,
                           int64_t mid_channels,
                           int64_t out_channels,
                           int64_t kernel_size = 3)
      : in_channels_(in_channels),
        mid_channels_(mid_channels),
        out_channels_(out_channels),
        kernel_size_(kernel_size) {}
  TORCH_ARG(int64_t, in_channels);
  /// Channels between the convolutions; the group size must divide it.
  TORCH_ARG(int64_t, mid_channels);
  TORCH_ARG(int64_t, out_channels);
  TORCH_ARG(int64_t, kernel_size);
  /// Padding of both convolutions (default: kernel_size / 2, "same" for odd kernels).
  TORCH_ARG(std::optional<int64_t>, padding) = std::nullopt;
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(GroupPtr, group) = {};
};

class ParallelConvBlock;

/// Conv2d (output channels split) -> BatchNorm2d (this rank's channels) -> ReLU -> Conv2d
/// (input channels split, all-reduced): one all-reduce forward, one backward.
class ParallelConvBlockImpl : public torch::nn::Cloneable<ParallelConvBlockImpl> {
 public:
  explicit ParallelConvBlockImpl(ParallelConvBlockOptions options)
      : ParallelConvBlockImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws conv1 then conv2 as torch::nn::Conv2d layers would be drawn.
  void reset_parameters();
  at::Tensor forward(const at::Tensor& x);
  /// Shards the dense conv1 -> norm -> (ReLU) -> conv2.
  static ParallelConvBlock from_dense(const torch::nn::Conv2d& conv1,
                                      const torch::nn::BatchNorm2d& norm,
                                      const torch::nn::Conv2d& conv2,
                                      GroupPtr group = {});
  /// Shards a torch_mp::dense::ConvBlock.
  static ParallelConvBlock from_dense(const dense::ConvBlock& block, GroupPtr group = {});
  /// A deep copy, its layouts recorded (Cloneable's copy replaces the children's tensors).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  ParallelConvBlockOptions options;
  ColumnParallelConv2d conv1 = nullptr;
  torch::nn::BatchNorm2d norm = nullptr;
  RowParallelConv2d conv2 = nullptr;

 private:
  ParallelConvBlockImpl(ParallelConvBlockOptions options, bool initialise);
  void register_layouts();
  bool initialise_ = true;
};
TORCH_MODULE(ParallelConvBlock);

}  // namespace torch_mp::tensor_parallel
