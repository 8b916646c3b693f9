// Bindings of expert parallelism (csrc/torch_mp/moe/): the configuration check the Python module
// runs when it is built. The forward is the operator torch.ops.torch_mp.moe. Argument conversion
// only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "torch_mp/moe/moe.h"

namespace py = pybind11;

namespace torch_mp::python {

void bind_moe(py::module_& parent) {
  auto m = parent.def_submodule("moe", "Expert parallelism (moe/)");
  m.def(
      "check_moe",
      [](int64_t hidden_size,
         int64_t ffn_hidden_size,
         int64_t num_experts,
         int64_t top_k,
         const std::string& activation,
         const std::string& router,
         std::optional<double> capacity_factor,
         double aux_loss_coef,
         bool bias,
         const std::string& group) {
        moe::check_moe(dense::MoEOptions(hidden_size, ffn_hidden_size, num_experts)
                           .top_k(top_k)
                           .activation(activation)
                           .router(router)
                           .capacity_factor(capacity_factor)
                           .aux_loss_coef(aux_loss_coef)
                           .bias(bias),
                       group_named_or_none(group));
      },
      py::arg("hidden_size"),
      py::arg("ffn_hidden_size"),
      py::arg("num_experts"),
      py::arg("top_k"),
      py::arg("activation"),
      py::arg("router"),
      py::arg("capacity_factor"),
      py::arg("aux_loss_coef"),
      py::arg("bias"),
      py::arg("group"),
      ReleaseGil());
}

}  // namespace torch_mp::python
