// pybind11 bindings of the C++ core: torch_mp._C. Nothing but argument conversion lives here.
// (How groups cross from Python: see python/common.h.)

#include <torch/extension.h>

#include "python/common.h"
#include "torch_mp/collectives.h"
#include "torch_mp/mesh.h"
#include "torch_mp/tensor_parallel/linear.h"
#include "torch_mp/tensor_parallel/random.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace py = pybind11;
namespace tp = torch_mp::tensor_parallel;

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

  // ---- random-number streams ----
  m.def(
      "rng_add",
      [](const std::string& name, uint64_t seed, const std::string& device) {
        tp::rng_tracker().add(name, seed, c10::Device(device));
      },
      py::arg("name"),
      py::arg("seed"),
      py::arg("device"));
  m.def(
      "rng_has",
      [](const std::string& name, const std::string& device) {
        return tp::rng_tracker().has(name, c10::Device(device));
      },
      py::arg("name"),
      py::arg("device"));
  m.def("rng_reset", [] { tp::rng_tracker().reset(); });
  m.def(
      "rng_swap_in",
      [](const std::string& name, const std::string& device) {
        return tp::rng_tracker().swap_in(name, c10::Device(device));
      },
      py::arg("name"),
      py::arg("device"));
  m.def(
      "rng_swap_out",
      [](const std::string& name, const std::string& device, const at::Tensor& default_state) {
        tp::rng_tracker().swap_out(name, c10::Device(device), default_state);
      },
      py::arg("name"),
      py::arg("device"),
      py::arg("default_state"));
  m.def(
      "model_parallel_manual_seed",
      [](uint64_t seed, const std::string& group, const std::string& device) {
        tp::model_parallel_manual_seed(seed, resolve(group), c10::Device(device));
      },
      py::arg("seed"),
      py::arg("group"),
      py::arg("device"));
  m.attr("MODEL_PARALLEL_RNG") = tp::kModelParallelRng;

  // ---- sharding ----
  m.def(
      "load_dense_linear_",
      [](at::Tensor weight,
         std::optional<at::Tensor> bias,
         const at::Tensor& dense_weight,
         const std::optional<at::Tensor>& dense_bias,
         int64_t shard_dim,
         const std::string& group) {
        tp::load_dense_linear_(weight, bias, dense_weight, dense_bias, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("dense_weight"),
      py::arg("dense_bias"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "gather_dense_linear",
      [](const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t shard_dim,
         const std::string& group) {
        return tp::gather_dense_linear(weight, bias, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());
  m.def("divide", &tp::divide, py::arg("size"), py::arg("parts"), py::arg("what"));

  // ---- parallel linear ----
  m.def(
      "column_parallel_linear",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t out_features,
         bool gather_output,
         bool sequence_parallel,
         const std::string& group) {
        return tp::column_parallel_linear(
            input, weight, bias, out_features, gather_output, sequence_parallel, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("out_features"),
      py::arg("gather_output"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "row_parallel_linear",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t in_features,
         bool input_is_parallel,
         bool sequence_parallel,
         const std::string& group) {
        return tp::row_parallel_linear(
            input, weight, bias, in_features, input_is_parallel, sequence_parallel, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("in_features"),
      py::arg("input_is_parallel"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_column_parallel_linear",
      [](int64_t in_features,
         int64_t out_features,
         bool bias,
         bool gather_output,
         bool sequence_parallel,
         const std::string& group) {
        tp::check_column_parallel_linear(
            in_features, out_features, bias, gather_output, sequence_parallel, resolve(group));
      },
      py::arg("in_features"),
      py::arg("out_features"),
      py::arg("bias"),
      py::arg("gather_output"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_row_parallel_linear",
      [](int64_t in_features,
         int64_t out_features,
         bool bias,
         bool input_is_parallel,
         bool sequence_parallel,
         const std::string& group) {
        tp::check_row_parallel_linear(
            in_features, out_features, bias, input_is_parallel, sequence_parallel, resolve(group));
      },
      py::arg("in_features"),
      py::arg("out_features"),
      py::arg("bias"),
      py::arg("input_is_parallel"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "init_parallel_linear_",
      [](at::Tensor weight,
         std::optional<at::Tensor> bias,
         int64_t in_features,
         int64_t out_features,
         int64_t shard_dim,
         const std::string& group) {
        tp::init_parallel_linear_(
            weight, bias, in_features, out_features, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("in_features"),
      py::arg("out_features"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());
}
