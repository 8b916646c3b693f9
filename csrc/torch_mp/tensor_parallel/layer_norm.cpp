#include "torch_mp/tensor_parallel/layer_norm.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_mp/collectives.h"
#include "torch_mp/operator_options.h"

namespace torch_mp::tensor_parallel {

at::Tensor layer_norm(const at::Tensor& input,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias,
                      double eps,
                      bool sequence_parallel,
                      const GroupPtr& group) {
  auto enter = [&](const std::optional<at::Tensor>& p) -> std::optional<at::Tensor> {
    if (!p || !p->defined()) {
      return std::nullopt;
    }
    return sequence_parallel ? copy_to_tp(*p, group) : *p;
  };
  return at::layer_norm_symint(input, {input.sym_size(-1)}, enter(weight), enter(bias), eps);
}

void check_layer_norm(const LayerNormOptions& o) {
  TORCH_CHECK_VALUE(
      o.normalized_shape().size() == 1 && o.normalized_shape()[0] > 0,
      "torch_mp LayerNorm normalises over the last dim only: normalized_shape must be "
      "one positive size");
}

namespace {

at::Tensor layer_norm_op(const at::Tensor& input,
                         const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias_tensor,
                         const LayerNormOptions& o) {
  check_layer_norm(o);
  TORCH_CHECK(input.sym_size(-1) == o.normalized_shape()[0],
              "LayerNorm: the input's last dim (",
              input.sym_size(-1),
              ") is not normalized_shape (",
              o.normalized_shape()[0],
              ")");
  return layer_norm(input, weight, bias_tensor, o.eps(), o.sequence_parallel(), o.group());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&layer_norm_op>(
      m, "layer_norm(Tensor input, Tensor? weight, Tensor? bias_tensor)");
}

}  // namespace torch_mp::tensor_parallel
