#pragma once
// Autograd-aware collectives over a tensor-parallel group (DESIGN.md §3).
//
//   op                    forward                 backward
//   copy_to_tp            identity                all-reduce
//   reduce_from_tp        all-reduce              identity
//   scatter_to_tp(dim)    split, keep own chunk   all-gather
//   gather_from_tp(dim)   all-gather              split
//   gather_from_sp(dim)   all-gather              reduce-scatter
//   reduce_scatter_to_sp  reduce-scatter          all-gather
//
// On a group of one rank each op is the identity. Split, all-gather and reduce-scatter need the
// size along `dim` to be divisible by the group size (scatter/reduce-scatter) and raise otherwise.

#include <ATen/core/Tensor.h>

#include "torch_mp/process_groups.h"

namespace torch_mp {

/// Identity forward; all-reduces the gradient. Enters a tensor-parallel region.
at::Tensor copy_to_tp(const at::Tensor& x, const GroupPtr& group);

/// All-reduces (sums) forward; identity backward. Leaves a tensor-parallel region.
at::Tensor reduce_from_tp(const at::Tensor& x, const GroupPtr& group);

/// Keeps this rank's chunk of `x` along `dim`; all-gathers the gradient.
at::Tensor scatter_to_tp(const at::Tensor& x, const GroupPtr& group, int64_t dim = -1);

/// All-gathers the chunks of every rank along `dim`; keeps this rank's chunk of the gradient.
at::Tensor gather_from_tp(const at::Tensor& x, const GroupPtr& group, int64_t dim = -1);

/// All-gathers a sequence-parallel tensor along the sequence `dim`; reduce-scatters the gradient.
at::Tensor gather_from_sp(const at::Tensor& x, const GroupPtr& group, int64_t dim = 0);

/// Reduce-scatters (sum, then keep own chunk) along the sequence `dim`; all-gathers the gradient.
at::Tensor reduce_scatter_to_sp(const at::Tensor& x, const GroupPtr& group, int64_t dim = 0);

/// Turns the collective checks on or off (default: on when the environment variable
/// TORCH_MP_CHECK_COLLECTIVES is 1). When on, every all-reduce, all-gather and reduce-scatter
/// first compares the ranks' dtypes and shapes, and the tensor-parallel entry points that take a
/// replicated tensor (copy_to_tp, the ids of VocabParallelEmbedding, the targets of
/// vocab_parallel_cross_entropy) compare its values: a rank with another shape, dtype or batch
/// raises on every rank, naming each rank's tensor, instead of aborting the process inside Gloo or
/// returning numbers computed from mismatched data. Costs one small all-gather per collective
/// (and a pass over replicated inputs).
void set_check_collectives(bool on);
/// Whether the collective checks are on.
bool check_collectives();

/// Plain (not differentiable) collectives that the ops above are made of. Each returns a new
/// tensor and leaves its input untouched.
namespace comm {

/// Sum (or the reduction `op`, e.g. c10d::ReduceOp::MAX) of `x` over the group.
at::Tensor all_reduce(const at::Tensor& x,
                      const GroupPtr& group,
                      c10d::ReduceOp op = c10d::ReduceOp::SUM);

/// The group's tensors concatenated along `dim`, in rank order.
at::Tensor all_gather(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// This rank's chunk along `dim` of the sum of `x` over the group.
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// This rank's chunk of `x` along `dim` (a contiguous copy).
at::Tensor split(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// Raises on every rank, naming the ranks that disagree, unless `values` is the same on all
/// ranks of the group. `what` names the values in the message.
void check_same_across_ranks(const std::vector<int64_t>& values,
                             const GroupPtr& group,
                             const std::string& what);

/// Raises on every rank, quoting each rank's `text`, unless `text` is the same on all ranks of
/// the group (compared in full through a digest; quoted up to 200 characters).
void check_same_text_across_ranks(const std::string& text,
                                  const GroupPtr& group,
                                  const std::string& what);

/// With the collective checks on (check_collectives), raises on every rank unless `x` is the
/// same on every rank of the group (dtype, shape and values); `what` names it.
void check_replicated(const at::Tensor& x, const GroupPtr& group, const std::string& what);

/// Raises on every rank unless `tensors` have the same count, dtypes and shapes on all ranks of
/// the group (one fixed-size exchange: the count and a digest of the rest).
void check_same_tensors_across_ranks(const std::vector<at::Tensor>& tensors,
                                     const GroupPtr& group,
                                     const std::string& what);

}  // namespace comm
}  // namespace torch_mp
