#pragma once
// LayerNorm inside a tensor-parallel block. Its parameters are replicated: every rank holds them
// whole. Under sequence parallelism each rank normalises its own rows only, so each rank's
// gradient of the parameters is a part of the dense one: they enter through copy_to_tp, which
// sums them over the group in backward.
//
// Also the PyTorch operator torch.ops.torch_mp.layer_norm(input, weight, bias, eps,
// sequence_parallel, group), which torch_mp.tensor_parallel.LayerNorm calls.

#include <ATen/core/Tensor.h>

#include <optional>

#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

/// LayerNorm over the last dim (torch.nn.functional.layer_norm). With `sequence_parallel` the
/// gradients of `weight` and `bias` are summed over `group`.
at::Tensor layer_norm(const at::Tensor& input,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias,
                      double eps,
                      bool sequence_parallel,
                      const GroupPtr& group);

}  // namespace torch_mp::tensor_parallel
