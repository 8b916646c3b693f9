// Bindings of expert parallelism (csrc/torch_mp/moe/): the declared options of the
// expert-parallel and the one-process mixtures of experts, and their checks. The forward is the
// operator torch.ops.torch_mp.moe. Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "python/layer_bindings.h"
#include "torch_mp/moe/moe.h"
#include "torch_mp/moe/router.h"

namespace py = pybind11;

namespace torch_mp::python {

void bind_moe(py::module_& parent) {
  bind_layer<moe::MoEOptions>("MoE", &moe::check_moe);
  bind_layer<dense::MoEOptions>("dense.MoE", &dense::check_moe);
  using Tensors = std::vector<std::optional<at::Tensor>>;  // router, fc1, fc1 bias, fc2, fc2 bias
  const auto parameters = [](const Tensors& t) {
    TORCH_CHECK(t.size() == 5 && t[0] && t[1] && t[3], "moe_load_dense_: five tensors");
    return moe::MoEParameters{*t[0], *t[1], t[2], *t[3], t[4]};
  };
  parent.def(
      "moe_route",
      [](const at::Tensor& tokens,
         const at::Tensor& router_weight,
         int64_t top_k,
         const std::string& router,
         std::optional<double> capacity_factor) {
        const auto r = moe::route(tokens, router_weight, top_k, router, capacity_factor);
        return std::make_tuple(r.experts, r.weights, r.probabilities, r.kept);
      },
      py::arg("tokens"),
      py::arg("router_weight"),
      py::arg("top_k"),
      py::arg("router"),
      py::arg("capacity_factor"),
      "Where `tokens` go (router.h: route): (experts, weights, probabilities, kept).");
  parent.def(
      "moe_load_dense_",
      [parameters](const Tensors& mine, const Tensors& dense, const std::string& group) {
        moe::load_dense_(parameters(mine), parameters(dense), resolve(group));
      },
      py::arg("mine"),
      py::arg("dense"),
      py::arg("group"),
      "Copies a dense MoE's router and this rank's experts (moe.h: load_dense_).");
}

}  // namespace torch_mp::python
