// pybind11 bindings of the distributed optimizer's sharding (csrc/torch_mp/optim/
// parameter_shards.h) as torch_mp._C.optim; torch_mp.DistributedOptimizer is built on it.
// Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
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
  py::class_<ParameterShards>(m, "ParameterShards", "Parameters cut over a data-parallel group.")
      .def(py::init([](std::vector<at::Tensor> parameters,
                       const std::string& group,
                       double bucket_cap_mb,
                       std::optional<at::ScalarType> master_dtype) {
             return std::make_unique<ParameterShards>(
                 std::move(parameters),
                 resolve(group),
                 ParameterShardsOptions().bucket_cap_mb(bucket_cap_mb).master_dtype(master_dtype));
           }),
           py::arg("parameters"),
           py::arg("group"),
           py::arg("bucket_cap_mb"),
           py::arg("master_dtype"),
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
      .def("take_gradients", &ParameterShards::take_gradients)
      .def("release_gradients", &ParameterShards::release_gradients)
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
          py::arg("per_parameter"));
}

}  // namespace torch_mp::python
