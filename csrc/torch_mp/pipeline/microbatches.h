#pragma once
// A batch as the pipeline runs it: split along dim 0 into equal micro-batches, and the last
// stage's per-micro-batch outputs joined back into whole-batch tensors.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_mp::pipeline {

/// Splits each tensor of `batch` along dim 0 into `num_microbatches` equal micro-batches:
/// result[m] holds micro-batch m of every tensor. Raises if a batch size is not divisible.
std::vector<std::vector<at::Tensor>> split_microbatches(const std::vector<at::Tensor>& batch,
                                                        int64_t num_microbatches);

/// The inverse of split_microbatches: result[i] is tensor i of every micro-batch of
/// `microbatches`, concatenated along dim 0 (empty when there are no micro-batches).
std::vector<at::Tensor> join_microbatches(const std::vector<std::vector<at::Tensor>>& microbatches);

/// How error messages name a list of tensors: "[Float[4, 16], Long[4]]".
std::string describe_tensors(const std::vector<at::Tensor>& tensors);

}  // namespace torch_mp::pipeline
