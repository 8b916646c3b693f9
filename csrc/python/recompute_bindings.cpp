// Bindings of recomputation (csrc/torch_mp/recompute.h): the scope in which the RNG tracker's
// streams may be drawn from, the probe that recognises torch.utils.checkpoint, and snapshots of
// the tracker's streams (torch_mp._C). Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "torch_mp/recompute.h"
#include "torch_mp/tensor_parallel/random.h"

namespace py = pybind11;

namespace torch_mp::python {
namespace {

// A RecomputeScope as a Python context manager (entered and left on one thread).
class PyRecomputeScope {
 public:
  void enter() { scope_.emplace(); }
  void exit() { scope_.reset(); }

 private:
  std::optional<RecomputeScope> scope_;
};

}  // namespace

void bind_recompute(py::module_& m) {
  py::class_<PyRecomputeScope>(m, "RecomputeScope")
      .def(py::init<>())
      .def("__enter__", [](PyRecomputeScope& self) { self.enter(); })
      .def("__exit__", [](PyRecomputeScope& self, py::args) {
        self.exit();
        return false;
      });
  m.def(
      "set_checkpoint_hooks_probe",
      [](py::function probe) {
        // Kept for the life of the process (never released: the core may ask it until exit, and
        // releasing it after the interpreter is gone would crash).
        PyObject* callable = probe.release().ptr();
        set_checkpoint_hooks_probe([callable] {
          py::gil_scoped_acquire gil;
          return py::handle(callable)().cast<bool>();
        });
      },
      py::arg("probe"));
  m.def("rng_states", [] { return tensor_parallel::rng_tracker().states(); });
  m.def(
      "rng_set_states",
      [](tensor_parallel::RngTracker::States states) {
        tensor_parallel::rng_tracker().set_states(std::move(states));
      },
      py::arg("states"));
}

}  // namespace torch_mp::python
