#pragma once
// Cross-entropy over logits whose last (vocabulary) dim is split across the tensor-parallel group,
// computed without gathering them: per-rank memory stays O(rows x vocab / t).
//
// Forward: the row max (one MAX all-reduce), then one pass over the shard for the sum of exp, the
// target's logit and the sum of logits (one SUM all-reduce of [rows, 3]). The exp values are kept
// for backward, which turns them into the gradient in place (one pass). On CUDA tensors both
// passes are fused kernels (csrc/torch_mp/tensor_parallel/cross_entropy_cuda.cu) when torch_mp was
// built with CUDA; the ATen code here is the CPU path and the reference.

#include <ATen/core/Reduction.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

/// Equals torch.nn.functional.cross_entropy(gathered_logits.flatten(0, -2), target.flatten(),
/// ignore_index=..., label_smoothing=..., reduction=...) reshaped as `target` for reduction
/// None, where gathered_logits is the ranks' `logits` [..., V_local] concatenated along the last
/// dim and cut to `vocab_size` entries.
///
/// `vocab_size` is the real vocabulary size when the shards are padded (as a
/// VocabParallelEmbedding's are: ceil(V / t) entries per rank); padded entries get no
/// probability and a zero gradient. Without it, every entry of every shard is vocabulary.
/// `target` [...] holds class ids in [0, vocab_size) or `ignore_index` and must be the same on
/// every rank (not checked: comparing them would cost a collective of their size). Invalid ids,
/// a shard that does not fit `vocab_size`, an invalid setting, or settings (vocab_size,
/// ignore_index, label_smoothing, reduction) that differ between ranks raise on every rank,
/// never leaving some waiting (they ride on the loss's first all-reduce). The logits' and
/// target's shapes and types must match across ranks.
/// Sums are taken in float (double for double logits); the result has the logits' type.
/// Backward may run once per forward (the exp buffer becomes the gradient in place).
///
/// With a `context_group` (context parallelism: each rank of it holds its part of the
/// sequence, context_parallel/sharding.h), "mean" and "sum" are over the tokens of every rank
/// of the context group: the same value on each, the mean over all their non-ignored targets.
/// The backward is the adjoint of that sum over the ranks, as DataParallel's averaging over
/// data x context ranks needs: each rank's logits get the gradient of the context group's
/// summed losses (cp times one process's), which the averaging divides by cp again. "none"
/// returns this rank's losses. One all-reduce of two numbers forward, one of one backward.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits,
                                        const at::Tensor& target,
                                        const GroupPtr& group,
                                        int64_t ignore_index = -100,
                                        double label_smoothing = 0.0,
                                        at::Reduction::Reduction reduction = at::Reduction::Mean,
                                        std::optional<int64_t> vocab_size = std::nullopt,
                                        const GroupPtr& context_group = {});

/// The same with `reduction` given by name: "none", "mean" or "sum" (another name raises on
/// every rank).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits,
                                        const at::Tensor& target,
                                        const GroupPtr& group,
                                        int64_t ignore_index,
                                        double label_smoothing,
                                        const std::string& reduction,
                                        std::optional<int64_t> vocab_size = std::nullopt,
                                        const GroupPtr& context_group = {});

/// Whether this build has the fused CUDA kernels (torch with CUDA and nvcc at build time).
bool has_fused_cuda_kernels();

}  // namespace torch_mp::tensor_parallel
