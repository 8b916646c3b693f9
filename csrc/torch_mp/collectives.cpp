#include "torch_mp/collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>

namespace torch_mp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- the plain collectives, called through the dispatcher ------------------------------------
// (so that torch.compile, tracing a backward or a layer, records them as operators)

using Reduce = at::Tensor(const at::Tensor&, c10::string_view, c10::string_view);
using AlongDim = at::Tensor(const at::Tensor&, int64_t, c10::string_view);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_operator(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor all_reduce(const at::Tensor& x, const std::string& group) {
  static const auto op = find_operator<Reduce>("torch_mp::all_reduce");
  return op.call(x, "sum", group);
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, const std::string& group) {
  static const auto op = find_operator<AlongDim>("torch_mp::all_gather");
  return op.call(x, dim, group);
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const std::string& group) {
  static const auto op = find_operator<AlongDim>("torch_mp::reduce_scatter");
  return op.call(x, dim, group);
}

at::Tensor split(const at::Tensor& x, int64_t dim, const std::string& group) {
  static const auto op = find_operator<AlongDim>("torch_mp::split");
  return op.call(x, dim, group);
}

// ---- the six autograd functions ---------------------------------------------------------------

std::string saved_group(AutogradContext* ctx) { return ctx->saved_data.at("group").toStringRef(); }

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group) {
    comm::check_replicated(
        x, group_named(group), "copy_to_tp: its input (replicated over the tensor group)");
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group) {
    return all_reduce(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// The four ops along a dim differ only in which plain collective runs forward and which
// backward: one Function template serves them all.
using Collective = at::Tensor (*)(const at::Tensor&, int64_t, const std::string&);

template <Collective Forward, Collective Backward>
struct AlongDimFunction : torch::autograd::Function<AlongDimFunction<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& x,
                            const std::string& group,
                            int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return Forward(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    return {Backward(grads[0], dim, saved_group(ctx)), at::Tensor(), at::Tensor()};
  }
};

using ScatterToTp = AlongDimFunction<&split, &all_gather>;
using GatherFromTp = AlongDimFunction<&all_gather, &split>;
using GatherFromSp = AlongDimFunction<&all_gather, &reduce_scatter>;
using ReduceScatterToSp = AlongDimFunction<&reduce_scatter, &all_gather>;

// ---- the operators' kernels -------------------------------------------------------------------
// Autograd: the functions above; the identity on a group of one rank.
// Below autograd (inference mode; Meta for shapes): the forward collective alone.

bool alone(c10::string_view group) { return group_named(group)->getSize() == 1; }

template <typename Function>
at::Tensor autograd_kernel(const at::Tensor& x, c10::string_view group) {
  return alone(group) ? x : Function::apply(x, std::string(group));
}

template <typename Function>
at::Tensor autograd_kernel_along(const at::Tensor& x, c10::string_view group, int64_t dim) {
  const int64_t wrapped = c10::maybe_wrap_dim(dim, x.dim());
  return alone(group) ? x : Function::apply(x, std::string(group), wrapped);
}

at::Tensor copy_forward(const at::Tensor& x, c10::string_view) { return x.clone(); }

at::Tensor reduce_forward(const at::Tensor& x, c10::string_view group) {
  return all_reduce(x, std::string(group));
}

template <Collective Forward>
at::Tensor forward_along(const at::Tensor& x, c10::string_view group, int64_t dim) {
  return Forward(x, c10::maybe_wrap_dim(dim, x.dim()), std::string(group));
}

using Mapping = at::Tensor(const at::Tensor&, c10::string_view);
using MappingAlong = at::Tensor(const at::Tensor&, c10::string_view, int64_t);

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const GroupPtr& group) {
  static const auto op = find_operator<Mapping>("torch_mp::copy_to_tp");
  return op.call(x, group_name(group));
}

at::Tensor reduce_from_tp(const at::Tensor& x, const GroupPtr& group) {
  static const auto op = find_operator<Mapping>("torch_mp::reduce_from_tp");
  return op.call(x, group_name(group));
}

at::Tensor scatter_to_tp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  static const auto op = find_operator<MappingAlong>("torch_mp::scatter_to_tp");
  return op.call(x, group_name(group), dim);
}

at::Tensor gather_from_tp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  static const auto op = find_operator<MappingAlong>("torch_mp::gather_from_tp");
  return op.call(x, group_name(group), dim);
}

at::Tensor gather_from_sp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  static const auto op = find_operator<MappingAlong>("torch_mp::gather_from_sp");
  return op.call(x, group_name(group), dim);
}

at::Tensor reduce_scatter_to_sp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  static const auto op = find_operator<MappingAlong>("torch_mp::reduce_scatter_to_sp");
  return op.call(x, group_name(group), dim);
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def("copy_to_tp(Tensor x, str group) -> Tensor");
  m.def("reduce_from_tp(Tensor x, str group) -> Tensor");
  m.def("scatter_to_tp(Tensor x, str group, int dim=-1) -> Tensor");
  m.def("gather_from_tp(Tensor x, str group, int dim=-1) -> Tensor");
  m.def("gather_from_sp(Tensor x, str group, int dim=0) -> Tensor");
  m.def("reduce_scatter_to_sp(Tensor x, str group, int dim=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) {
  m.impl("copy_to_tp", &autograd_kernel<CopyToTp>);
  m.impl("reduce_from_tp", &autograd_kernel<ReduceFromTp>);
  m.impl("scatter_to_tp", &autograd_kernel_along<ScatterToTp>);
  m.impl("gather_from_tp", &autograd_kernel_along<GatherFromTp>);
  m.impl("gather_from_sp", &autograd_kernel_along<GatherFromSp>);
  m.impl("reduce_scatter_to_sp", &autograd_kernel_along<ReduceScatterToSp>);
}

// These serve meta tensors too: the plain collectives they call have meta kernels.
TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("copy_to_tp", &copy_forward);
  m.impl("reduce_from_tp", &reduce_forward);
  m.impl("scatter_to_tp", &forward_along<&split>);
  m.impl("gather_from_tp", &forward_along<&all_gather>);
  m.impl("gather_from_sp", &forward_along<&all_gather>);
  m.impl("reduce_scatter_to_sp", &forward_along<&reduce_scatter>);
}

}  // namespace torch_mp
