#pragma once
// A transformer encoder layer with tensor-parallel attention and MLP: the same layer as
// torch_mp::dense::TransformerLayer (torch.nn.TransformerEncoderLayer: post-LN
// norm2(y + mlp(y)) with y = norm1(x + attn(x)), or pre-LN x + attn(norm1(x)) then
// + mlp(norm2(.)) with norm_first) and torch::nn::TransformerEncoderLayer (post-LN, with
// biases), given the same weights.
// Under sequence parallelism the LayerNorms, dropouts and residuals act on each rank's s / t
// rows, the replicated LayerNorm parameters getting the dense gradients (layer_norm.h). Under
// context parallelism (context_parallel) each rank holds its part of the sequence, cut by
// context_parallel::shard_sequence, and only the attention meets the other parts (attention.h);
// dropout is refused there in training (the ranks' masks could not be one process's).
//
// The forward (the residual order, the norms, which dropout draws from which stream) is defined
// here once: the C++ module calls parallel_transformer_layer, the Python module the PyTorch
// operator torch.ops.torch_mp.parallel_transformer_layer, a composition of the same.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>

#include "torch_mp/dense.h"
#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/tensor_parallel/attention.h"
#include "torch_mp/tensor_parallel/layer_norm.h"
#include "torch_mp/tensor_parallel/mlp.h"

namespace torch_mp::tensor_parallel {

/// The options of ParallelTransformerLayer, declared once (torch_mp/options.h); defaults as
/// torch::nn::TransformerEncoderLayer's:
/// - hidden_size, num_heads, ffn_hidden_size: d_model, nhead, dim_feedforward;
/// - dropout, activation ("relu" or "gelu"), layer_norm_eps: as the dense layer's;
/// - norm_first: pre-LN (x + f(norm(x))) instead of post-LN (norm(x + f(x)));
/// - bias: biases of the projections and the LayerNorms;
/// - sequence_parallel: input and output split along the sequence dim (0);
/// - group: the tensor-parallel group; the default mesh's when null;
/// - recompute: activation recomputation: "" keeps every activation for the backward; "full"
///   keeps the layer's input only and recomputes the whole layer in the backward; "selective"
///   recomputes the attention core only (scores, softmax, dropout, the product with V: the
///   activations that grow with s^2; Megatron's choice). Both replay the dropout masks
///   (torch_mp::recompute), so the gradients equal those without recomputation, and both
///   compose with the pipeline's zero-bubble split (one recomputation, each gradient once);
/// - context_parallel, context_group, context_method, load_balance: the sequence split over a
///   context group too, as ParallelSelfAttentionOptions' (the context group the default mesh's
///   when unset);
/// - softmax_scale: the attention's (1 / sqrt(head_dim) when unset).
#define TORCH_MP_PARALLEL_TRANSFORMER_LAYER_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, hidden_size)                                               \
  REQUIRED(int64_t, num_heads)                                                 \
  OPTION(int64_t, ffn_hidden_size, 2048)                                       \
  OPTION(double, dropout, 0.1)                                                 \
  OPTION(std::string, activation, "relu")                                      \
  OPTION(double, layer_norm_eps, 1e-5)                                         \
  OPTION(bool, norm_first, false)                                              \
  OPTION(bool, bias, true)                                                     \
  OPTION(bool, sequence_parallel, false)                                       \
  OPTION(GroupPtr, group, {})                                                  \
  KEYWORD(std::string, recompute, "")                                          \
  KEYWORD(bool, context_parallel, false)                                       \
  KEYWORD(GroupPtr, context_group, {})                                         \
  KEYWORD(std::string, context_method, "ring")                                 \
  KEYWORD(bool, load_balance, true)                                            \
  KEYWORD(std::optional<double>, softmax_scale, std::nullopt)

/// Options of ParallelTransformerLayer.
struct ParallelTransformerLayerOptions {
  TORCH_MP_OPTIONS(ParallelTransformerLayerOptions, TORCH_MP_PARALLEL_TRANSFORMER_LAYER_OPTIONS)
  /// The sizes, as torch::nn::TransformerEncoderLayerOptions(d_model, nhead) with
  /// dim_feedforward.
  ParallelTransformerLayerOptions(int64_t hidden_size, int64_t num_heads, int64_t ffn_hidden_size)
      : ParallelTransformerLayerOptions(hidden_size, num_heads) {
    ffn_hidden_size_ = ffn_hidden_size;
  }
};

/// What a transformer layer checks beyond its attention's and MLP's checks: `recompute` one of
/// "", "full" and "selective", and the same options on every rank of options.group().
void check_parallel_transformer_layer(const ParallelTransformerLayerOptions& options);

/// This rank's parameters of a transformer layer (the norms' replicated, whole).
struct TransformerLayerParameters {
  std::optional<at::Tensor> norm1_weight;
  std::optional<at::Tensor> norm1_bias;
  AttentionParameters attention;
  std::optional<at::Tensor> norm2_weight;
  std::optional<at::Tensor> norm2_bias;
  MLPParameters mlp;
};

/// The attention, MLP and LayerNorm options a layer with `options` builds its blocks with (the
/// C++ module's norms are dense::LayerNorm with these sizes, eps and bias).
ParallelSelfAttentionOptions attention_options(const ParallelTransformerLayerOptions& options);
ParallelMLPOptions mlp_options(const ParallelTransformerLayerOptions& options);
LayerNormOptions norm_options(const ParallelTransformerLayerOptions& options);

/// The forward of ParallelTransformerLayer: `x` [s, b, h] ([s / t, b, h] under sequence
/// parallelism), the mask as in attention_heads, dropout only when `training`. Dropout on whole
/// tensors draws from the default generator (the same on every rank), on sequence-parallel rows
/// from the per-rank stream. `options.group()` must be set, and `options.context_group()` with
/// context_parallel.
at::Tensor parallel_transformer_layer(const at::Tensor& x,
                                      const TransformerLayerParameters& parameters,
                                      const ParallelTransformerLayerOptions& options,
                                      const std::optional<at::Tensor>& attn_mask,
                                      bool is_causal,
                                      bool training);

class ParallelTransformerLayer;

/// A transformer encoder layer (self-attention and MLP, each with a residual and LayerNorm).
class ParallelTransformerLayerImpl : public torch::nn::Cloneable<ParallelTransformerLayerImpl> {
 public:
  explicit ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options)
      : ParallelTransformerLayerImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws the weights of a dense::TransformerLayer with these options and loads them.
  void reset_parameters();
  /// `x` [s, b, h] ([s / t, b, h] under sequence parallelism); mask as in attention_heads.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& attn_mask = {}, bool is_causal = false);
  /// The parameters as parallel_transformer_layer takes them.
  TransformerLayerParameters weights() const;
  /// Shards `dense` (its options, pre- or post-LN, with or without biases, kept).
  /// `recompute` and `context_parallel` as the options (the context group the mesh's, the ring,
  /// load-balanced; set the options for others).
  static ParallelTransformerLayer from_dense(const dense::TransformerLayer& dense,
                                             GroupPtr group = {},
                                             bool sequence_parallel = false,
                                             std::string recompute = "",
                                             bool context_parallel = false);
  /// Shards `dense` (a post-LN layer with biases, as LibTorch's are).
  static ParallelTransformerLayer from_dense(const torch::nn::TransformerEncoderLayer& dense,
                                             GroupPtr group = {},
                                             bool sequence_parallel = false,
                                             std::string recompute = "",
                                             bool context_parallel = false);
  /// Shards `dense` with `options` (its sizes, dropout, activation, norms and biases taken
  /// from `dense`; the parallel settings from `options`).
  static ParallelTransformerLayer from_dense(const dense::TransformerLayer& dense,
                                             ParallelTransformerLayerOptions options);

  /// Allocated, not initialised (for modules that fill it).
  static ParallelTransformerLayer uninitialised(ParallelTransformerLayerOptions options);

  /// Copies this rank's shards of `dense` into the parameters.
  void load_dense(const dense::TransformerLayer& dense);
  void load_dense(const torch::nn::TransformerEncoderLayer& dense);
  /// Parameter names in the dense layer, by prefix (torch_mp::checkpoint).
  static const DenseNames& dense_names();

  ParallelTransformerLayerOptions options;
  dense::LayerNorm norm1 = nullptr;
  ParallelSelfAttention self_attn = nullptr;
  dense::LayerNorm norm2 = nullptr;
  ParallelMLP mlp = nullptr;

 private:
  ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options, bool initialise);
  bool initialise_ = true;
};
TORCH_MODULE(ParallelTransformerLayer);

}  // namespace torch_mp::tensor_parallel
