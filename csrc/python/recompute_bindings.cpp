// Bindings of recomputation (csrc/torch_mp/recompute.h): the scope in which the RNG tracker's
// streams may be drawn from, and the probe that recognises torch.utils.checkpoint (torch_mp._C).
// Snapshots of the tracker's streams are bound with the tracker (tensor_parallel_bindings.cpp).
// Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "torch_mp/recompute.h"

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
  m.def(
      "set_traced_recompute",
      [](py::function form) {
        // Kept for the life of the process, as the probe.
        PyObject* callable = form.release().ptr();
        set_traced_recompute(
            [callable](const RecomputeFunction& fn, const std::vector<at::Tensor>& inputs) {
              py::gil_scoped_acquire gil;
              const py::cpp_function run([fn](const std::vector<at::Tensor>& in) {
                const RecomputeScope scope;
                return fn(in);
              });
              return py::handle(callable)(run, inputs).cast<std::vector<at::Tensor>>();
            });
      },
      py::arg("form"),
      "Installs the traced form of recompute: form(fn, inputs) -> outputs, fn(inputs) -> "
      "outputs.");
}

}  // namespace torch_mp::python
