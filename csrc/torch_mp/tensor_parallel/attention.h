#pragma once
// Self-attention with the heads split across the tensor-parallel group: a column-parallel QKV
// projection, attention over this rank's heads, a row-parallel output projection. Equals
// torch::nn::MultiheadAttention applied as self-attention given the same weights.
//
// Layout: [s, b, h] (sequence first); under sequence parallelism each rank holds [s / t, b, h]
// of the input and output. Rank r holds heads [r * n / t, (r + 1) * n / t), i.e. the matching
// rows of each of Q, K and V.
//
// Under context parallelism (context_parallel/) the sequence is split over a context group as
// well: each rank's s is its part of the whole sequence's S tokens (cut by shard_sequence: with
// load_balance, chunks r and 2 cp - 1 - r of 2 cp), the attention meets the other parts' keys and
// values by the method chosen, and masks are for the whole sequence ([S, S] or
// [b * num_heads, S, S]). Heads are split first (tensor group), then the sequence (context group).
//
// The forward is also the PyTorch operator torch.ops.torch_mp.parallel_self_attention (the
// parameters below, the mask, is_causal and training, then the declared options by keyword), and
// attention over the local heads torch.ops.torch_mp.attention_heads: compositions, what the Python
// module calls.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/tensor_parallel/linear.h"

namespace torch_mp::tensor_parallel {

/// (prefix of a module's own parameter names, prefix of its dense counterpart's) pairs.
using DenseNames = std::vector<std::pair<std::string, std::string>>;

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

/// The options of ParallelSelfAttention, declared once (torch_mp/options.h):
/// - hidden_size: embedding size h; num_heads divides it;
/// - num_heads: attention heads in all; the group size must divide it;
/// - bias: biases on the projections;
/// - dropout: on the attention probabilities (in training);
/// - sequence_parallel: input and output split along the sequence dim (0);
/// - group: the tensor-parallel group; the default mesh's when null;
/// - recompute_core: recompute the attention core (scores, softmax, dropout, the product with
///   V) in the backward instead of keeping its activations (attention_heads);
/// - context_parallel: the sequence split over a context group too (see the top of this file):
///   input and output hold this rank's part of the sequence, cut by shard_sequence;
/// - context_group: the context group; the default mesh's when unset (with context_parallel
///   only);
/// - context_method: how the ranks' keys and values meet: "ring", "all_gather" or
///   "all_to_all" (context_parallel/attention.h);
/// - load_balance: whether the sequence was cut load-balanced (shard_sequence's default);
/// - softmax_scale: what the scores q k^T are multiplied by before the softmax; 1 / sqrt(head_dim)
///   when unset.
#define TORCH_MP_PARALLEL_SELF_ATTENTION_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, hidden_size)                                            \
  REQUIRED(int64_t, num_heads)                                              \
  OPTION(bool, bias, true)                                                  \
  OPTION(double, dropout, 0.0)                                              \
  OPTION(bool, sequence_parallel, false)                                    \
  OPTION(GroupPtr, group, {})                                               \
  KEYWORD(bool, recompute_core, false)                                      \
  KEYWORD(bool, context_parallel, false)                                    \
  KEYWORD(GroupPtr, context_group, {})                                      \
  KEYWORD(std::string, context_method, "ring")                              \
  KEYWORD(bool, load_balance, true)                                         \
  KEYWORD(std::optional<double>, softmax_scale, std::nullopt)

/// Options of ParallelSelfAttention.
struct ParallelSelfAttentionOptions {
  TORCH_MP_OPTIONS(ParallelSelfAttentionOptions, TORCH_MP_PARALLEL_SELF_ATTENTION_OPTIONS)
};

/// Checks a self-attention's options: num_heads divides hidden_size, the group size divides
/// num_heads, a context group only with context_parallel and then a known context_method, and
/// the same options on every rank of the group and of the context group. options.group() must
/// be set, and options.context_group() with context_parallel.
void check_parallel_self_attention(const ParallelSelfAttentionOptions& options);

/// Scaled dot-product attention over this rank's heads, with the options of a
/// ParallelSelfAttention: of `num_heads` in all, rank r of `group` holds heads
/// [r * n / t, (r + 1) * n / t). `qkv` [s, b, 3 * h_local] holds this rank's Q, K and V columns
/// one after the other; returns [s, b, h_local]. `attn_mask` follows
/// torch::nn::MultiheadAttention: [s, s] or [b * num_heads, s, s] (every head's; this rank uses
/// its own), bool (true = may not attend) or float (added). `is_causal` without a mask applies
/// the causal mask. The scores are scaled by `softmax_scale` (1 / sqrt(head_dim) when unset).
/// Dropout on the attention probabilities (`dropout` > 0, when `training`) draws from the
/// per-rank stream (region_dropout), computing the softmax explicitly; without it the fused
/// scaled_dot_product_attention runs. With `recompute_core` the attention itself (scores,
/// softmax, dropout, the product with V) keeps only `qkv` and is recomputed in the backward
/// (torch_mp::recompute: the same dropout masks), Megatron's selective recomputation.
///
/// With `context_parallel`, `qkv` holds this rank's part of the sequence (see the top of this
/// file), the attention is context_parallel::attention over `context_group` by
/// `context_method` ("ring", "all_gather" or "all_to_all") over the cut `load_balance` names,
/// and the masks are for the whole sequence. Attention dropout is refused there: the ranks'
/// masks could not be the ones one process would draw. Of the options' sizes only num_heads is
/// used (hidden_size, bias and sequence_parallel are the projections'). Also the operator
/// torch.ops.torch_mp.attention_heads(qkv, attn_mask, is_causal, training, *, <the options>).
at::Tensor attention_heads(const at::Tensor& qkv,
                           const ParallelSelfAttentionOptions& options,
                           const std::optional<at::Tensor>& attn_mask,
                           bool is_causal,
                           bool training);

/// The options of an attention's Q/K/V projection (hidden -> 3 hidden, column-parallel) and
/// output projection (hidden -> hidden, row-parallel).
ColumnParallelLinearOptions qkv_options(const ParallelSelfAttentionOptions& options);
RowParallelLinearOptions proj_options(const ParallelSelfAttentionOptions& options);

/// This rank's parameters of a self-attention: the QKV projection's [3h/t, h] weight (and
/// [3h/t] bias) and the output projection's [h, h/t] weight (and whole [h] bias).
struct AttentionParameters {
  at::Tensor qkv_weight;
  std::optional<at::Tensor> qkv_bias;
  at::Tensor proj_weight;
  std::optional<at::Tensor> proj_bias;
};

/// The forward of ParallelSelfAttention: `x` [s, b, h] ([s / t, b, h] under sequence
/// parallelism); the mask as in attention_heads; dropout only when `training`. `options.group()`
/// must be set, and `options.context_group()` with context_parallel.
at::Tensor parallel_self_attention(const at::Tensor& x,
                                   const AttentionParameters& parameters,
                                   const ParallelSelfAttentionOptions& options,
                                   const std::optional<at::Tensor>& attn_mask,
                                   bool is_causal,
                                   bool training);

class ParallelSelfAttention;

/// Multi-head self-attention with the heads split across the group (see the top of this file).
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
  /// The parameters as parallel_self_attention takes them.
  AttentionParameters weights() const;
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

}  // namespace torch_mp::tensor_parallel
