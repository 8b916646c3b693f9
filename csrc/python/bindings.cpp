// pybind11 bindings of the C++ core: torch_mp._C. Nothing but argument conversion lives here.
// (How groups cross from Python: see python/common.h.) The collectives and the layers' forwards
// are PyTorch operators (torch.ops.torch_mp.*), registered by the core itself; importing this
// module loads them.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "torch_mp/agreement.h"
#include "torch_mp/collectives.h"
#include "torch_mp/comm.h"
#include "torch_mp/errors.h"
#include "torch_mp/live_storages.h"
#include "torch_mp/mesh.h"

namespace py = pybind11;

namespace torch_mp::python {
void bind_checkpoint(py::module_& parent);        // checkpoint_bindings.cpp
void bind_data_parallel(py::module_& parent);     // data_parallel_bindings.cpp
void bind_layer_declarations(py::module_& m);     // layer_bindings.cpp
void bind_optim(py::module_& parent);             // optim_bindings.cpp
void bind_pipeline(py::module_& parent);          // pipeline_bindings.cpp
void bind_plan(py::module_& module);              // plan_bindings.cpp
void bind_recompute(py::module_& module);         // recompute_bindings.cpp
void bind_context_parallel(py::module_& module);  // context_parallel_bindings.cpp
void bind_moe(py::module_& module);               // moe_bindings.cpp
void bind_tensor_parallel(py::module_& module);   // tensor_parallel_bindings.cpp
}  // namespace torch_mp::python

using torch_mp::python::ReleaseGil;
using torch_mp::python::resolve;

namespace {

// torch_mp.LayoutError: made once, at import, kept for the process's life.
PyObject* layout_error = nullptr;

// The one translator of the core's typed refusals (torch_mp/errors.h) into Python types; c10's
// own (c10::ValueError as ValueError, ...) torch's translator already gives.
void bind_errors(py::module_& m) {
  const py::tuple bases =
      py::make_tuple(py::handle(PyExc_ValueError), py::handle(PyExc_RuntimeError));
  layout_error = PyErr_NewExceptionWithDoc(
      "torch_mp.LayoutError",
      "A layout the model cannot take: a size not divisible by a parallel degree, or a setting "
      "the layout cannot run (torch_mp::LayoutError). Raised alike by the runtime and by "
      "torch_mp.plan.estimate, with the same message. A ValueError; also a RuntimeError, what "
      "these refusals were before they had a type.",
      bases.ptr(),
      nullptr);
  if (layout_error == nullptr) {
    throw py::error_already_set();
  }
  m.attr("LayoutError") = py::handle(layout_error);
  py::register_local_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) {
        std::rethrow_exception(raised);
      }
    } catch (const torch_mp::LayoutError& e) {
      PyErr_SetString(layout_error, e.what_without_backtrace());
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_mp C++ core (use the torch_mp package, not this module)";
  bind_errors(m);
  torch_mp::python::bind_layer_declarations(m);
  torch_mp::python::bind_data_parallel(m);
  torch_mp::python::bind_optim(m);
  torch_mp::python::bind_pipeline(m);
  torch_mp::python::bind_plan(m);
  torch_mp::python::bind_checkpoint(m);
  torch_mp::python::bind_tensor_parallel(m);
  torch_mp::python::bind_recompute(m);
  torch_mp::python::bind_context_parallel(m);
  torch_mp::python::bind_moe(m);

  // ---- mesh ----
  m.def(
      "mesh_shape",
      [](int64_t world_size,
         int64_t tp,
         int64_t pp,
         std::optional<int64_t> dp,
         int64_t cp,
         int64_t ep) {
        const auto shape = torch_mp::MeshShape::infer(world_size, tp, pp, dp, cp, ep);
        return py::make_tuple(shape.tp, shape.pp, shape.dp);
      },
      py::arg("world_size"),
      py::arg("tp"),
      py::arg("pp"),
      py::arg("dp"),
      py::arg("cp") = 1,
      py::arg("ep") = 1);
  m.def(
      "mesh_groups",
      [](int64_t tp, int64_t pp, int64_t dp, int64_t cp, int64_t ep) {
        const torch_mp::MeshShape shape{tp, pp, dp, cp, ep};
        py::dict groups;
        groups["tp"] = shape.groups(torch_mp::Axis::kTensor);
        groups["dp"] = shape.groups(torch_mp::Axis::kData);
        groups["pp"] = shape.groups(torch_mp::Axis::kPipeline);
        groups["cp"] = shape.groups(torch_mp::Axis::kContext);
        if (cp > 1) {  // (the data groups themselves otherwise)
          groups["dp_cp"] = shape.data_context_groups();
        }
        groups["ep"] = shape.expert_groups();
        if (ep > 1) {  // (the data x context groups themselves otherwise)
          groups["expert_dp"] = shape.expert_data_groups();
        }
        groups["embedding"] = shape.embedding_groups();
        return groups;
      },
      py::arg("tp"),
      py::arg("pp"),
      py::arg("dp"),
      py::arg("cp") = 1,
      py::arg("ep") = 1);
  m.def(
      "check_same_across_ranks",
      [](const std::vector<int64_t>& values, const std::string& group, const std::string& what) {
        torch_mp::comm::check_same_across_ranks(values, resolve(group), what);
      },
      py::arg("values"),
      py::arg("group"),
      py::arg("what"),
      ReleaseGil());

  m.def(
      "raise_anywhere",
      [](const std::vector<std::string>& problems,
         const std::string& what,
         const std::string& group) {
        torch_mp::raise_anywhere(problems, what, torch_mp::group_named_or_none(group));
      },
      py::arg("problems"),
      py::arg("what"),
      py::arg("group"),
      ReleaseGil(),
      "Raises on every rank of `group` (\"\": this rank only) if any rank has `problems`: "
      "\"<what> on rank <r>: <its problems>\", this rank's own if it has any.");
  m.def(
      "device_of",
      [](const std::string& group) { return torch_mp::device_of(resolve(group)).str(); },
      py::arg("group"),
      "Where `group`'s collectives take their tensors: \"cuda\" for an NCCL group, else "
      "\"cpu\".");
  m.def(
      "barrier",
      [](const std::string& group) { torch_mp::comm::barrier(resolve(group)); },
      py::arg("group"),
      ReleaseGil());
  m.def(
      "all_gather_bytes",
      [](const py::bytes& mine, const std::string& group) {
        std::vector<std::string> all;
        {
          const std::string text = mine;
          py::gil_scoped_release no_gil;
          all = torch_mp::comm::all_gather_text(text, resolve(group));
        }
        py::list out;
        for (const auto& text : all) {
          out.append(py::bytes(text));
        }
        return out;
      },
      py::arg("mine"),
      py::arg("group"),
      "Every rank's bytes, in rank order, on every rank.");
  m.def(
      "all_gather_named",
      [](const std::map<std::string, at::Tensor>& mine, const std::string& group) {
        return torch_mp::comm::all_gather_named(mine, resolve(group));
      },
      py::arg("mine"),
      py::arg("group"),
      ReleaseGil(),
      "The union of every rank's named tensors, on every rank.");

  m.def("set_check_collectives", &torch_mp::set_check_collectives, py::arg("on"));
  m.def("check_collectives", &torch_mp::check_collectives);

  py::class_<torch_mp::LiveStorages>(m, "LiveStorages", "live_storages.h (torch_mp._memory)")
      .def(py::init<>())
      .def("add", &torch_mp::LiveStorages::add, py::arg("inputs"), py::arg("outputs"))
      .def("bytes", &torch_mp::LiveStorages::bytes);
}
