#pragma once
// The all-to-all of Ulysses attention: `x` split along one dim into as many parts as the group
// has ranks, part j sent to rank j, the parts received concatenated along another dim in rank
// order. From sequence-sharded [b, heads, s / cp, d] to head-sharded [b, heads / cp, s, d]
// (split_dim 1, concat_dim 2) and back (split_dim 2, concat_dim 1).
//
//   torch.ops.torch_mp.all_to_all(Tensor x, int split_dim, int concat_dim, str group)
//     its backward is the all-to-all the other way (concat_dim split, split_dim concatenated)

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torch_mp/process_groups.h"

namespace torch_mp::context_parallel {

/// `x`'s parts along `split_dim` exchanged over `group`, concatenated along `concat_dim`.
/// Raises, naming the rank, if the group size does not divide x's size along `split_dim`.
at::Tensor all_to_all(const at::Tensor& x,
                      int64_t split_dim,
                      int64_t concat_dim,
                      const GroupPtr& group);

}  // namespace torch_mp::context_parallel
