#pragma once
// Plain (not differentiable) collectives over a c10d process group: the pieces the autograd
// collectives (collectives.h) and the layers are made of. Each returns a new tensor and leaves
// its input untouched, waits for the collective, and turns a dead or silent peer into an error
// that says so.
//
// They are also PyTorch operators, groups passed by name (process_groups.h: group_name) as
// PyTorch's functional collectives take them, each with a meta kernel that gives its output's
// shape without communicating, so torch.compile traces through them:
//
//   torch.ops.torch_mp.all_reduce(Tensor x, str reduce_op, str group) -> Tensor   "sum" | "max"
//   torch.ops.torch_mp.all_gather(Tensor x, int dim, str group) -> Tensor
//   torch.ops.torch_mp.reduce_scatter(Tensor x, int dim, str group) -> Tensor
//   torch.ops.torch_mp.split(Tensor x, int dim, str group) -> Tensor    this rank's chunk

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torch_mp/process_groups.h"

namespace torch_mp::comm {

/// Sum (or the reduction `op`, e.g. c10d::ReduceOp::MAX) of `x` over the group.
at::Tensor all_reduce(const at::Tensor& x,
                      const GroupPtr& group,
                      c10d::ReduceOp op = c10d::ReduceOp::SUM);

/// The group's tensors concatenated along `dim`, in rank order.
at::Tensor all_gather(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// Writes the group's `input`s into `output` (1-D, group size x input's elements), in rank
/// order: an all-gather without the concatenation's copy. `input` may be this rank's range of
/// `output` (in place).
void all_gather_into(const at::Tensor& output, const at::Tensor& input, const GroupPtr& group);
/// all_gather_into, started: `output` is complete once the returned work is waited for (wait).
c10::intrusive_ptr<c10d::Work> start_all_gather_into(const at::Tensor& output,
                                                     const at::Tensor& input,
                                                     const GroupPtr& group);

/// Waits for an asynchronous collective `op` on `group`, turning a dead or silent peer into an
/// error that says so.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupPtr& group, const char* op);

/// This rank's chunk along `dim` of the sum of `x` over the group.
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// This rank's chunk of `x` along `dim` (a contiguous copy).
at::Tensor split(const at::Tensor& x, int64_t dim, const GroupPtr& group);

}  // namespace torch_mp::comm
