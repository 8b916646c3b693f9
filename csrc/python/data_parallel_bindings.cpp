// pybind11 bindings of data parallelism, parameter layouts and mesh-wide gradient clipping
// (torch_mp._C.data_parallel and torch_mp._C).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "torch_mp/data_parallel/gradient_sync.h"
#include "torch_mp/data_parallel/sharded_state.h"
#include "torch_mp/layout.h"
#include "torch_mp/optim/clip_grad.h"

namespace py = pybind11;

namespace torch_mp::python {
namespace {

GroupPtr resolve_optional(const std::optional<std::string>& name) {
  return name ? resolve(*name) : GroupPtr();
}

}  // namespace

void bind_data_parallel(py::module_& parent) {
  using namespace torch_mp::data_parallel;
  auto m = parent.def_submodule("data_parallel", "Data-parallel gradient synchronisation");
  m.def(
      "is_expert_parameter",
      [](const at::Tensor& parameter, const std::string& expert_group) {
        return is_expert_parameter(parameter, group_named_or_none(expert_group));
      },
      py::arg("parameter"),
      py::arg("expert_group"));
  m.def("check_reductions_complete",
        &check_reductions_complete,
        py::arg("parameters"),
        "Raises, naming them, if the last synced backward of a DataParallel that reduces some "
        "of these parameters gave some of its parameters no gradient.");
  py::class_<GradientSync>(m, "GradientSync", "Bucketed, overlapped gradient averaging.")
      .def(py::init([](std::vector<at::Tensor> parameters,
                       std::vector<at::Tensor> buffers,
                       const std::string& group,
                       double bucket_cap_mb,
                       bool gradient_as_bucket_view,
                       bool broadcast_buffers,
                       const std::string& comm_hook,
                       const std::string& expert_group,
                       const std::string& expert_data_group,
                       std::vector<std::string> names) {
             return std::make_unique<GradientSync>(
                 std::move(parameters),
                 std::move(buffers),
                 resolve(group),
                 GradientSyncOptions()
                     .bucket_cap_mb(bucket_cap_mb)
                     .gradient_as_bucket_view(gradient_as_bucket_view)
                     .broadcast_buffers(broadcast_buffers)
                     .comm_hook(parse_comm_hook(comm_hook))
                     .expert_group(group_named_or_none(expert_group))
                     .expert_data_group(group_named_or_none(expert_data_group))
                     .names(std::move(names)));
           }),
           py::arg("parameters"),
           py::arg("buffers"),
           py::arg("group"),
           py::arg("bucket_cap_mb"),
           py::arg("gradient_as_bucket_view"),
           py::arg("broadcast_buffers"),
           py::arg("comm_hook"),
           py::arg("expert_group") = "",
           py::arg("expert_data_group") = "",
           py::arg("names") = std::vector<std::string>{},
           ReleaseGil())
      .def("prepare_for_forward", &GradientSync::prepare_for_forward, ReleaseGil())
      .def("prepare_for_backward", &GradientSync::prepare_for_backward, ReleaseGil());
  py::class_<ShardedState, std::shared_ptr<ShardedState>>(
      m, "ShardedState", "Bucketed gradient reduce-scatter (ZeRO-2), fp32 main gradients.")
      .def(py::init([](std::vector<at::Tensor> parameters,
                       std::vector<at::Tensor> buffers,
                       const std::string& group,
                       double bucket_cap_mb,
                       std::optional<at::ScalarType> grad_dtype,
                       bool broadcast_buffers,
                       std::vector<std::string> names,
                       bool shard_parameters,
                       std::vector<size_t> units) {
             return ShardedState::create(std::move(parameters),
                                         std::move(buffers),
                                         resolve(group),
                                         ShardedStateOptions()
                                             .bucket_cap_mb(bucket_cap_mb)
                                             .grad_dtype(grad_dtype)
                                             .broadcast_buffers(broadcast_buffers)
                                             .names(std::move(names))
                                             .shard_parameters(shard_parameters)
                                             .units(std::move(units)));
           }),
           py::arg("parameters"),
           py::arg("buffers"),
           py::arg("group"),
           py::arg("bucket_cap_mb"),
           py::arg("grad_dtype"),
           py::arg("broadcast_buffers"),
           py::arg("names") = std::vector<std::string>{},
           py::arg("shard_parameters") = false,
           py::arg("units") = std::vector<size_t>{},
           ReleaseGil())
      .def("prepare_for_forward", &ShardedState::prepare_for_forward, ReleaseGil())
      .def("prepare_for_backward", &ShardedState::prepare_for_backward, ReleaseGil())
      .def("zero_grad", &ShardedState::zero_grad, ReleaseGil())
      .def("before_forward", &ShardedState::before_forward, py::arg("unit"), ReleaseGil())
      .def("after_forward", &ShardedState::after_forward, py::arg("unit"), ReleaseGil())
      .def("before_backward", &ShardedState::before_backward, py::arg("unit"), ReleaseGil())
      .def("gather_parameters", &ShardedState::gather_parameters, ReleaseGil())
      .def("free_parameters", &ShardedState::free_parameters, ReleaseGil())
      .def("write_back_parameters", &ShardedState::write_back_parameters, ReleaseGil())
      .def("parameter_shape", &ShardedState::parameter_shape, py::arg("parameter"))
      .def_property_readonly("shards_parameters", &ShardedState::shards_parameters)
      .def(
          "bytes",
          [](const ShardedState& state) {
            const auto b = state.bytes();
            py::dict d;
            d["main_gradients"] = b.main_gradients;
            d["reduced_gradients"] = b.reduced_gradients;
            d["staging"] = b.staging;
            d["parameter_shards"] = b.parameter_shards;
            return d;
          },
          "The bytes it holds now, by kind (data_parallel::ShardedBytes).")
      .def_static(
          "manages",
          [](const at::Tensor& p) { return ShardedState::of(p) != nullptr; },
          py::arg("parameter"))
      .def_static("of", &ShardedState::of, py::arg("parameter"));
  m.attr("ShardedGradientSync") = m.attr("ShardedState");  // (its former name)
  py::class_<WholeParameters>(
      m, "WholeParameters", "The sharded (ZeRO-3) parameters among these, whole until release.")
      .def(py::init<const std::vector<at::Tensor>&, bool>(),
           py::arg("parameters"),
           py::arg("write_back") = false,
           ReleaseGil())
      .def_property_readonly("gathered", &WholeParameters::gathered)
      .def("release", &WholeParameters::release, ReleaseGil());

  // ---- parameter layouts ----
  py::class_<ParameterLayout>(parent, "ParameterLayout", "How a parameter lies on the mesh.")
      .def_readonly("shard_dim", &ParameterLayout::shard_dim)
      .def_readonly("tied_copy", &ParameterLayout::tied_copy)
      .def_readonly("parts", &ParameterLayout::parts)
      .def_readonly("dense_size", &ParameterLayout::dense_size)
      .def_property_readonly("is_sharded", &ParameterLayout::is_sharded)
      .def_property_readonly("group_name",
                             [](const ParameterLayout& l) -> std::optional<std::string> {
                               if (!l.group) {
                                 return std::nullopt;
                               }
                               return l.group->getGroupName();
                             })
      .def("__repr__", [](const ParameterLayout& l) {
        std::string text = l.shard_dim ? "sharded(dim=" + std::to_string(*l.shard_dim) + ")"
                                       : std::string("replicated()");
        return "ParameterLayout(" + text + (l.tied_copy ? ", tied_copy" : "") + ")";
      });
  parent.def(
      "set_layout",
      [](const at::Tensor& parameter,
         std::optional<int64_t> shard_dim,
         const std::optional<std::string>& group,
         int64_t parts,
         std::optional<int64_t> dense_size) {
        set_layout(parameter,
                   ParameterLayout{shard_dim, resolve_optional(group), false, parts, dense_size});
      },
      py::arg("parameter"),
      py::arg("shard_dim"),
      py::arg("group"),
      py::arg("parts") = 1,
      py::arg("dense_size") = std::nullopt);
  parent.def(
      "set_weight_and_bias_layout",
      [](const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t shard_dim,
         const std::string& group) {
        set_weight_and_bias_layout(weight, bias.value_or(at::Tensor()), shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("shard_dim"),
      py::arg("group"));
  parent.def("layout_of", &layout_of, py::arg("parameter"));

  // ---- norms and clipping ----
  parent.def(
      "clip_grad_norm_",
      [](const std::vector<at::Tensor>& parameters,
         double max_norm,
         double norm_type,
         const std::optional<std::string>& tp_group,
         const std::optional<std::string>& pp_group,
         bool error_if_nonfinite,
         const std::optional<std::string>& ep_group) {
        return clip_grad_norm_(parameters,
                               max_norm,
                               norm_type,
                               resolve_optional(tp_group),
                               resolve_optional(pp_group),
                               error_if_nonfinite,
                               resolve_optional(ep_group));
      },
      py::arg("parameters"),
      py::arg("max_norm"),
      py::arg("norm_type"),
      py::arg("tp_group"),
      py::arg("pp_group"),
      py::arg("error_if_nonfinite"),
      py::arg("ep_group") = std::nullopt,
      ReleaseGil());
  parent.def(
      "total_grad_norm",
      [](const std::vector<at::Tensor>& parameters,
         double norm_type,
         const std::optional<std::string>& tp_group,
         const std::optional<std::string>& pp_group,
         const std::optional<std::string>& ep_group) {
        return total_grad_norm(parameters,
                               norm_type,
                               resolve_optional(tp_group),
                               resolve_optional(pp_group),
                               resolve_optional(ep_group));
      },
      py::arg("parameters"),
      py::arg("norm_type"),
      py::arg("tp_group"),
      py::arg("pp_group"),
      py::arg("ep_group") = std::nullopt,
      ReleaseGil());
}

}  // namespace torch_mp::python
