#pragma once
// LayerNorm inside a tensor-parallel block. Its parameters are replicated: every rank holds them
// whole. Under sequence parallelism each rank normalises its own rows only, so each rank's
// gradient of the parameters is a part of the dense one: they enter through copy_to_tp, which
// sums them over the group in backward.
//
// Also the PyTorch operator torch.ops.torch_mp.layer_norm(input, weight, bias_tensor, *,
// <LayerNormOptions>), which torch_mp.tensor_parallel.LayerNorm calls.

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "torch_mp/options.h"
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

/// The options of the Python module torch_mp.tensor_parallel.LayerNorm (torch.nn.LayerNorm's,
/// over the last dim only, and sequence_parallel and group), declared once (torch_mp/options.h).
/// The C++ modules use torch_mp::dense::LayerNorm and call layer_norm.
#define TORCH_MP_LAYER_NORM_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(std::vector<int64_t>, normalized_shape)             \
  OPTION(double, eps, 1e-5)                                    \
  OPTION(bool, elementwise_affine, true)                       \
  OPTION(bool, bias, true)                                     \
  OPTION(bool, sequence_parallel, false)                       \
  OPTION(GroupPtr, group, {})

/// Options of the tensor-parallel LayerNorm.
struct LayerNormOptions {
  TORCH_MP_OPTIONS(LayerNormOptions, TORCH_MP_LAYER_NORM_OPTIONS)
};

/// Checks a LayerNorm's options: one normalised (the last) dim, of positive size.
void check_layer_norm(const LayerNormOptions& options);

}  // namespace torch_mp::tensor_parallel
