#pragma once
// Attention over sequences split across a context group (sharding.h): each rank holds its
// part of the queries, keys and values, [b, heads, s / cp, d] (the layout of
// scaled_dot_product_attention), and gets its part of the output, equal to attention over the
// whole sequence cut the same way, forward and backward. Three ways to meet the other ranks'
// keys and values:
//
//   "ring"        K/V blocks passed around the ring point to point, the next block's transfer
//                 overlapped with this block's compute, partial outputs merged by their
//                 log-sum-exp; under a causal mask, blocks wholly in the future skipped. The
//                 backward is a second ring carrying the blocks' dK/dV home.
//   "all_gather"  K/V all-gathered, this rank's queries attending to all of them (backward:
//                 their gradients reduce-scattered). Cheap for grouped-query attention.
//   "all_to_all"  Ulysses: an all-to-all from sequence-sharded to head-sharded, attention over
//                 the whole sequence on heads / cp heads, an all-to-all back. The heads (and
//                 K/V heads) must be divisible by cp.
//
// K and V may have fewer heads than Q (grouped-query attention) where they divide them. A mask
// `attn_mask` is for the whole sequence, as scaled_dot_product_attention would take it on the
// whole sequence (boolean: true takes part; float: added to the scores), broadcastable to
// [b, heads, s, s]; the ring takes causal masks only.
//
//   torch.ops.torch_mp.context_attention(Tensor q, Tensor k, Tensor v, str group,
//       bool is_causal=False, float? scale=None, str method="ring", bool load_balance=True,
//       Tensor? attn_mask=None) -> Tensor

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "torch_mp/process_groups.h"

namespace torch_mp::context_parallel {

/// The methods attention knows, by name.
inline constexpr std::array<std::string_view, 3> kAttentionMethods{
    "ring", "all_gather", "all_to_all"};

/// Options of attention.
struct AttentionOptions {
  /// A causal mask over the whole sequence.
  TORCH_ARG(bool, is_causal) = false;
  /// The scores' scale; 1 / sqrt(d) when unset.
  TORCH_ARG(std::optional<double>, scale) = std::nullopt;
  /// "ring", "all_gather" or "all_to_all".
  TORCH_ARG(std::string, method) = "ring";
  /// Whether the sequence was cut load-balanced (sharding.h), as shard_sequence's default.
  TORCH_ARG(bool, load_balance) = true;
  /// A mask for the whole sequence (all_gather and all_to_all only).
  TORCH_ARG(std::optional<at::Tensor>, attn_mask) = std::nullopt;
};

/// This rank's part of attention over the whole sequence, from this rank's parts `q`, `k`,
/// `v` ([b, heads, s / cp, d]; K and V may have fewer heads). Collective over `group`. Raises,
/// on every rank, if the ranks' shapes differ, the heads do not divide as the method needs, or
/// the method is unknown. `options.load_balance()` must be the cut's (a mismatch cannot be
/// detected).
at::Tensor attention(const at::Tensor& q,
                     const at::Tensor& k,
                     const at::Tensor& v,
                     const GroupPtr& group,
                     const AttentionOptions& options = {});

}  // namespace torch_mp::context_parallel
