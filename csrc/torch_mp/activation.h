#pragma once
// The activation kinds the MLPs take, by name, in one place: the dense modules (dense.h) and the
// tensor-parallel ones (tensor_parallel/mlp.h) both apply them.

#include <ATen/core/Tensor.h>

#include <string>

namespace torch_mp {

/// Raises "torch_mp: activation must be 'relu' or 'gelu', got '<name>'" for any other name.
void check_activation(const std::string& name);

/// gelu (exact) or relu of `x`.
at::Tensor activation(const at::Tensor& x, const std::string& name);

}  // namespace torch_mp
