#include "torch_mp/tensor_parallel/layer_norm.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_mp/collectives.h"

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

namespace {

at::Tensor layer_norm_op(const at::Tensor& input,
                         const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias,
                         double eps,
                         bool sequence_parallel,
                         c10::string_view group) {
  return layer_norm(input, weight, bias, eps, sequence_parallel, group_named(group));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def(
      "layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps, bool sequence_parallel, "
      "str group) -> Tensor",
      &layer_norm_op);
}

}  // namespace torch_mp::tensor_parallel
