// pybind11 bindings of the distributed optimizer's sharding (csrc/torch_mp/optim/
// parameter_shards.h) and of loss scaling (csrc/torch_mp/optim/grad_scaler.h) as torch_mp._C.optim;
// torch_mp.DistributedOptimizer and torch_mp.GradScaler are built on them. Argument conversion
// only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "torch_mp/optim/grad_scaler.h"
#include "torch_mp/optim/parameter_shards.h"

namespace py = pybind11;

namespace torch_mp::python {
namespace {

// Python's None as the core's undefined tensor.
std::vector<at::Tensor> undefined_for_none(const std::vector<std::optional<at::Tensor>>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    out.push_back(t.value_or(at::Tensor()));
  }
  return out;
}

}  // namespace

void bind_optim(py::module_& parent) {
  using namespace torch_mp::optim;
  auto m = parent.def_submodule("optim", "The distributed optimizer's parameter shards");
  m.def("wait_for_gathers",
        &wait_for_gathers,
        py::arg("parameters"),
        ReleaseGil(),
        "Waits for a DistributedOptimizer's overlapped all-gather of these parameters.");
  py::class_<ParameterShards>(m, "ParameterShards", "Parameters cut over a data-parallel group.")
      .def(py::init([](std::vector<at::Tensor> parameters,
                       const std::string& group,
                       double bucket_cap_mb,
                       std::optional<at::ScalarType> master_dtype,
                       const std::string& expert_group,
                       std::vector<std::string> names,
                       bool overlap_param_gather) {
             return std::make_unique<ParameterShards>(
                 std::move(parameters),
                 resolve(group),
                 ParameterShardsOptions()
                     .bucket_cap_mb(bucket_cap_mb)
                     .master_dtype(master_dtype)
                     .expert_group(group_named_or_none(expert_group))
                     .names(std::move(names))
                     .overlap_param_gather(overlap_param_gather));
           }),
           py::arg("parameters"),
           py::arg("group"),
           py::arg("bucket_cap_mb"),
           py::arg("master_dtype"),
           py::arg("expert_group") = "",
           py::arg("names") = std::vector<std::string>{},
           py::arg("overlap_param_gather") = false,
           ReleaseGil())
      .def_property_readonly("shards", &ParameterShards::shards)
      .def_property_readonly("pieces",
                             [](const ParameterShards& self) {
                               std::vector<std::tuple<size_t, int64_t, int64_t>> out;
                               for (const auto& p : self.pieces()) {
                                 out.emplace_back(p.parameter, p.offset, p.numel);
                               }
                               return out;
                             })
      .def_property_readonly("num_buckets", &ParameterShards::num_buckets)
      .def("shape", &ParameterShards::shape, py::arg("parameter"))
      // (Every call that may wait for a collective releases the GIL: Gloo's threads take it
      // to free the tensors of a finished work.)
      .def("take_gradients", &ParameterShards::take_gradients, ReleaseGil())
      .def("release_gradients", &ParameterShards::release_gradients, ReleaseGil())
      .def("zero_gradients", &ParameterShards::zero_gradients, ReleaseGil())
      .def("wait_for_parameters", &ParameterShards::wait_for_parameters, ReleaseGil())
      .def_property_readonly("pending_gathers", &ParameterShards::pending_gathers)
      .def("gather_parameters", &ParameterShards::gather_parameters, ReleaseGil())
      .def(
          "gather",
          [](const ParameterShards& self, const std::vector<std::optional<at::Tensor>>& per_shard) {
            return self.gather(undefined_for_none(per_shard));
          },
          py::arg("per_shard"),
          ReleaseGil())
      .def(
          "slice",
          [](const ParameterShards& self, const std::vector<std::optional<at::Tensor>>& whole) {
            std::vector<std::optional<at::Tensor>> out;
            for (auto& piece : self.slice(undefined_for_none(whole))) {
              out.push_back(piece.defined() ? std::optional<at::Tensor>(piece) : std::nullopt);
            }
            return out;
          },
          py::arg("per_parameter"),
          ReleaseGil());

  py::class_<GradScaler>(m, "GradScaler", "Dynamic loss scaling agreed over the mesh.")
      .def(py::init([](double init_scale,
                       double growth_factor,
                       double backoff_factor,
                       int64_t growth_interval,
                       bool enabled,
                       const std::string& tp_group,
                       const std::string& pp_group,
                       const std::string& dp_group) {
             return std::make_unique<GradScaler>(GradScalerOptions()
                                                     .init_scale(init_scale)
                                                     .growth_factor(growth_factor)
                                                     .backoff_factor(backoff_factor)
                                                     .growth_interval(growth_interval)
                                                     .enabled(enabled),
                                                 resolve(tp_group),
                                                 resolve(pp_group),
                                                 resolve(dp_group));
           }),
           py::arg("init_scale"),
           py::arg("growth_factor"),
           py::arg("backoff_factor"),
           py::arg("growth_interval"),
           py::arg("enabled"),
           py::arg("tp_group"),
           py::arg("pp_group"),
           py::arg("dp_group"))
      .def("scale", &GradScaler::scale, py::arg("loss"))
      .def("unscale_", &GradScaler::unscale_, py::arg("parameters"), ReleaseGil())
      .def_property_readonly("found_inf", &GradScaler::found_inf)
      .def_property_readonly("unscaled", &GradScaler::unscaled)
      .def("update", &GradScaler::update)
      .def("get_scale", &GradScaler::get_scale)
      .def_property_readonly("growth_tracker", &GradScaler::growth_tracker)
      .def("load", &GradScaler::load, py::arg("scale"), py::arg("growth_tracker"));
}

}  // namespace torch_mp::python
