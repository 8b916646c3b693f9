#pragma once
// Cutting dense tensors into tensor-parallel shards and putting them back together.

#include <ATen/core/Tensor.h>

#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

/// `size / parts`; raises, naming `what` (e.g. "ColumnParallelLinear: out_features"), unless
/// `parts` divides `size`.
int64_t divide(int64_t size, int64_t parts, const std::string& what);

/// Chunk `index` of `parts` equal chunks of `full` along `dim`, as a contiguous copy.
at::Tensor shard(const at::Tensor& full, int64_t dim, int64_t index, int64_t parts);

/// This rank's shard of `full` along `dim` for `group`.
at::Tensor shard(const at::Tensor& full, int64_t dim, const GroupPtr& group);

/// The dense tensor whose shards along `dim` the ranks of `group` hold (an all-gather, not
/// differentiable). Every rank gets the whole tensor.
at::Tensor unshard(const at::Tensor& local, int64_t dim, const GroupPtr& group);

}  // namespace torch_mp::tensor_parallel
