#pragma once
// Gradient norms and clipping over the whole mesh, equal to torch.nn.utils.clip_grad_norm_ on
// the dense model: sharded parameters contribute every rank's part, replicated ones are counted
// once (on rank 0 of their group), tied copies not at all, and the pipeline stages' parts are
// combined. Data-parallel replicas hold equal gradients after their reduction and are not
// combined, except gradients that a DataParallel(shard_gradients=True) reduce-scattered: their
// pieces are summed over its data group. A mixture of experts' experts (sharded over the expert
// group, moe/) are summed over it: each of its ranks holds other experts. Layouts come from
// torch_mp/layout.h.

#include <ATen/core/Tensor.h>

#include <vector>

#include "torch_mp/mesh.h"

namespace torch_mp {

/// The norm of order `norm_type` (inf for the max norm) of all gradients of the model, as one
/// vector. `parameters` are this rank's; those without a gradient are skipped. A collective over
/// `tp_group`, `pp_group` and `ep_group` (any may be null for a size of one).
///
/// Raises if a sharded parameter's group is not `tp_group` or `ep_group`, or `norm_type` is not
/// positive.
at::Tensor total_grad_norm(const std::vector<at::Tensor>& parameters,
                           double norm_type,
                           const GroupPtr& tp_group,
                           const GroupPtr& pp_group,
                           const GroupPtr& ep_group = {});

/// Scales the gradients so that their total norm (total_grad_norm) is at most `max_norm`, as
/// torch.nn.utils.clip_grad_norm_ does, and returns the total norm before clipping.
///
/// With `error_if_nonfinite`, a NaN or infinite norm raises (on every rank: they all see the
/// same norm) instead of being returned; the gradients are then left as they are.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                           double max_norm,
                           double norm_type,
                           const GroupPtr& tp_group,
                           const GroupPtr& pp_group,
                           bool error_if_nonfinite = false,
                           const GroupPtr& ep_group = {});

/// The gradient tensors of `parameters` on this rank, what an optimizer over them steps from:
/// each one's .grad, or this rank's pieces of those a DataParallel(shard_gradients=True) holds
/// (views into its buckets: writing into them changes what the optimizer steps with). Those
/// without a gradient are left out.
std::vector<at::Tensor> local_gradients(const std::vector<at::Tensor>& parameters);

/// clip_grad_norm_ over the groups of `mesh` (the default mesh when null).
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                           double max_norm,
                           double norm_type = 2.0,
                           std::shared_ptr<Mesh> mesh = nullptr,
                           bool error_if_nonfinite = false);

}  // namespace torch_mp
