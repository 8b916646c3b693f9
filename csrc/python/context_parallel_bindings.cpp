// Bindings of context parallelism (csrc/torch_mp/context_parallel/): the positions a rank
// holds. shard_sequence, unshard_sequence and attention are operators
// (torch.ops.torch_mp.*), which Python calls directly. Argument conversion only.

#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include "torch_mp/context_parallel/sharding.h"

namespace py = pybind11;

namespace torch_mp::python {

void bind_context_parallel(py::module_& parent) {
  auto m = parent.def_submodule("context_parallel", "Context parallelism (context_parallel/)");
  m.def("sequence_positions",
        &context_parallel::sequence_positions,
        py::arg("sequence_length"),
        py::arg("rank"),
        py::arg("size"),
        py::arg("load_balance") = true);
}

}  // namespace torch_mp::python
