// The core's collectives as PyTorch operators, torch.ops.torch_mp.*, groups passed by name as
// PyTorch's own functional collectives take them. Each has a meta kernel that gives its output's
// shape without communicating, so torch.compile traces through them (torch_mp/ops.py builds the
// differentiable collectives and the layers' traceable forwards from them).
//
//   all_reduce(Tensor x, str reduce_op, str group) -> Tensor   reduce_op: "sum" or "max"
//   all_gather(Tensor x, int dim, str group) -> Tensor          concatenated along dim
//   reduce_scatter(Tensor x, int dim, str group) -> Tensor      this rank's chunk of the sum
//   split(Tensor x, int dim, str group) -> Tensor               this rank's chunk, no communication

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/library.h>

#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "torch_mp/collectives.h"

namespace torch_mp {
namespace {

GroupPtr group_named(c10::string_view name) {
  return c10d::resolve_process_group(std::string(name));
}

c10d::ReduceOp reduce_op(c10::string_view name) {
  if (name == "sum") {
    return c10d::ReduceOp::SUM;
  }
  TORCH_CHECK(name == "max", "torch_mp::all_reduce: reduce_op must be 'sum' or 'max', got ", name);
  return c10d::ReduceOp::MAX;
}

at::Tensor all_reduce(const at::Tensor& x, c10::string_view op, c10::string_view group) {
  return comm::all_reduce(x, group_named(group), reduce_op(op));
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return comm::all_gather(x, dim, group_named(group));
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return comm::reduce_scatter(x, dim, group_named(group));
}

at::Tensor split(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return comm::split(x, dim, group_named(group));
}

/// `x`'s shape with dim `dim` multiplied (`grow`) or divided by the group's size, in symbolic
/// sizes (torch.compile's dynamic shapes); the real kernels check divisibility.
at::Tensor resized_like(const at::Tensor& x, int64_t dim, c10::string_view group, bool grow) {
  const int64_t size = group_named(group)->getSize();
  auto sizes = x.sym_sizes().vec();
  dim = c10::maybe_wrap_dim(dim, x.dim());
  sizes[dim] = grow ? sizes[dim] * size : sizes[dim] / size;
  return at::empty_symint(sizes, x.options());
}

at::Tensor all_reduce_meta(const at::Tensor& x, c10::string_view op, c10::string_view) {
  reduce_op(op);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

at::Tensor all_gather_meta(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return resized_like(x, dim, group, /*grow=*/true);
}

at::Tensor chunk_meta(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return resized_like(x, dim, group, /*grow=*/false);
}

}  // namespace

TORCH_LIBRARY(torch_mp, m) {
  m.def("all_reduce(Tensor x, str reduce_op, str group) -> Tensor");
  m.def("all_gather(Tensor x, int dim, str group) -> Tensor");
  m.def("reduce_scatter(Tensor x, int dim, str group) -> Tensor");
  m.def("split(Tensor x, int dim, str group) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_gather", &all_gather);
  m.impl("reduce_scatter", &reduce_scatter);
  m.impl("split", &split);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("all_reduce", &all_reduce_meta);
  m.impl("all_gather", &all_gather_meta);
  m.impl("reduce_scatter", &chunk_meta);
  m.impl("split", &chunk_meta);
}

}  // namespace torch_mp
