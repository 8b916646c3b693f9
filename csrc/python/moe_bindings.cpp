// Bindings of expert parallelism (csrc/torch_mp/moe/): the declared options of the
// expert-parallel and the one-process mixtures of experts, and their checks. The forward is the
// operator torch.ops.torch_mp.moe. Argument conversion only.

#include <pybind11/pybind11.h>

#include "python/layer_bindings.h"
#include "torch_mp/moe/moe.h"

namespace py = pybind11;

namespace torch_mp::python {

void bind_moe(py::module_& parent) {
  bind_layer<moe::MoEOptions>("MoE", &moe::check_moe);
  bind_layer<dense::MoEOptions>("dense.MoE", &dense::check_moe);
}

}  // namespace torch_mp::python
