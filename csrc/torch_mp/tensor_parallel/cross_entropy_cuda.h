#pragma once
// Fused CUDA kernels of vocab_parallel_cross_entropy (compiled only when torch has CUDA).

#include <ATen/core/Tensor.h>

#include <tuple>

namespace torch_mp::cuda {

/// One pass over this rank's logit shard `logits` [N, V_local] (contiguous; float, half or
/// bfloat16). `row_max` [N] float32: the max over the whole (all ranks') vocabulary of each row.
/// `target_local` [N] int64: the target's column in this shard, or -1 when the target is not on
/// this
///    shard (or the row is ignored).
/// Columns >= `real_columns` are vocabulary padding: they get exp = 0 and contribute nothing.
/// Returns {exp_logits [N, V_local] (same dtype as logits): exp(z - row_max) for real columns, 0
/// for
///          padding;
///          stats [N, 3] float32: column 0 = sum over real columns of exp(z - max),
///                                column 1 = z[target] - max if the target is here else 0,
///                                column 2 = sum over real columns of (z - max)}.
std::tuple<at::Tensor, at::Tensor> vocab_cross_entropy_forward(const at::Tensor& logits,
                                                               const at::Tensor& row_max,
                                                               const at::Tensor& target_local,
                                                               int64_t real_columns);

/// In place, one pass: turns `exp_logits` [N, V_local] (from the forward) into the gradient of the
/// loss w.r.t. the logit shard: for real columns c: (exp[c] / sum_exp[n] - (1 - smoothing) *
/// [c == target_local[n]] - smoothing / vocab_size) * row_scale[n]; padding columns: 0.
/// `sum_exp` [N] float32 (the all-reduced sum over all ranks), `row_scale` [N] float32
/// (dLoss/dloss_n; 0 for ignored rows), `vocab_size` the real vocabulary size over all ranks.
void vocab_cross_entropy_backward_(at::Tensor& exp_logits,
                                   const at::Tensor& sum_exp,
                                   const at::Tensor& target_local,
                                   const at::Tensor& row_scale,
                                   double smoothing,
                                   int64_t vocab_size,
                                   int64_t real_columns);

}  // namespace torch_mp::cuda
