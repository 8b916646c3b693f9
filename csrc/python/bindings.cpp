// pybind11 bindings of the C++ core: torch_mp._C. Nothing but argument conversion lives here.
// (How groups cross from Python: see python/common.h.)

#include <torch/extension.h>

#include "python/common.h"
#include "torch_mp/collectives.h"
#include "torch_mp/mesh.h"

namespace py = pybind11;

namespace torch_mp::python {
void bind_checkpoint(py::module_& parent);       // checkpoint_bindings.cpp
void bind_data_parallel(py::module_& parent);    // data_parallel_bindings.cpp
void bind_pipeline(py::module_& parent);         // pipeline_bindings.cpp
void bind_tensor_parallel(py::module_& module);  // tensor_parallel_bindings.cpp
}  // namespace torch_mp::python

namespace {

using torch_mp::python::ReleaseGil;
using torch_mp::python::resolve;

// Binds a collective `op(x, group)` or `op(x, group, dim)` under `name`.
template <typename Fn>
void def_collective(py::module_& m, const char* name, Fn op) {
  m.def(
      name,
      [op](const at::Tensor& x, const std::string& group) { return op(x, resolve(group)); },
      py::arg("x"),
      py::arg("group"),
      ReleaseGil());
}

template <typename Fn>
void def_collective_along(py::module_& m, const char* name, Fn op) {
  m.def(
      name,
      [op](const at::Tensor& x, const std::string& group, int64_t dim) {
        return op(x, resolve(group), dim);
      },
      py::arg("x"),
      py::arg("group"),
      py::arg("dim"),
      ReleaseGil());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_mp C++ core (use the torch_mp package, not this module)";
  torch_mp::python::bind_data_parallel(m);
  torch_mp::python::bind_pipeline(m);
  torch_mp::python::bind_checkpoint(m);
  torch_mp::python::bind_tensor_parallel(m);

  // ---- mesh ----
  m.def(
      "mesh_shape",
      [](int64_t world_size, int64_t tp, int64_t pp, std::optional<int64_t> dp) {
        const auto shape = torch_mp::MeshShape::infer(world_size, tp, pp, dp);
        return py::make_tuple(shape.tp, shape.pp, shape.dp);
      },
      py::arg("world_size"),
      py::arg("tp"),
      py::arg("pp"),
      py::arg("dp"));
  m.def(
      "mesh_groups",
      [](int64_t tp, int64_t pp, int64_t dp) {
        const torch_mp::MeshShape shape{tp, pp, dp};
        py::dict groups;
        groups["tp"] = shape.groups(torch_mp::Axis::kTensor);
        groups["dp"] = shape.groups(torch_mp::Axis::kData);
        groups["pp"] = shape.groups(torch_mp::Axis::kPipeline);
        groups["embedding"] = shape.embedding_groups();
        return groups;
      },
      py::arg("tp"),
      py::arg("pp"),
      py::arg("dp"));
  m.def(
      "check_same_across_ranks",
      [](const std::vector<int64_t>& values, const std::string& group, const std::string& what) {
        torch_mp::comm::check_same_across_ranks(values, resolve(group), what);
      },
      py::arg("values"),
      py::arg("group"),
      py::arg("what"),
      ReleaseGil());

  m.def("set_check_collectives", &torch_mp::set_check_collectives, py::arg("on"));
  m.def("check_collectives", &torch_mp::check_collectives);

  // ---- autograd collectives ----
  def_collective(m, "copy_to_tp", &torch_mp::copy_to_tp);
  def_collective(m, "reduce_from_tp", &torch_mp::reduce_from_tp);
  def_collective_along(m, "scatter_to_tp", &torch_mp::scatter_to_tp);
  def_collective_along(m, "gather_from_tp", &torch_mp::gather_from_tp);
  def_collective_along(m, "gather_from_sp", &torch_mp::gather_from_sp);
  def_collective_along(m, "reduce_scatter_to_sp", &torch_mp::reduce_scatter_to_sp);
}
