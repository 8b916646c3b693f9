#pragma once
// Autograd-aware collectives over a tensor-parallel group (docs/design.md §3.1).
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
//
// Each is also the PyTorch operator torch.ops.torch_mp.<op>(Tensor x, str group[, int dim]),
// its backward implemented here (an Autograd-key kernel) from the plain collectives of comm.h,
// so eager code and torch.compile run the same definition. The layers of tensor_parallel/ are
// compositions of these.

#include <ATen/core/Tensor.h>

#include "torch_mp/agreement.h"  // IWYU pragma: export
#include "torch_mp/comm.h"       // IWYU pragma: export
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

}  // namespace torch_mp
