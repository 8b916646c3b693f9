// The all-to-all of Ulysses attention (all_to_all.h).

#include "torch_mp/context_parallel/all_to_all.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"

namespace torch_mp::context_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor exchange_kernel(const at::Tensor& x,
                           int64_t split_dim,
                           int64_t concat_dim,
                           c10::string_view group_name) {
  const auto group = group_named(group_name);
  const int64_t size = group->getSize();
  split_dim = c10::maybe_wrap_dim(split_dim, x.dim());
  concat_dim = c10::maybe_wrap_dim(concat_dim, x.dim());
  TORCH_CHECK(x.size(split_dim) % size == 0,
              "torch_mp.context_parallel.all_to_all: size ",
              x.size(split_dim),
              " of dim ",
              split_dim,
              " is not divisible by the context-parallel size (",
              size,
              ") on rank ",
              group->getRank());
  if (size == 1) {
    return x.clone(at::MemoryFormat::Contiguous);
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.push_back(split_dim);
  shape.push_back(concat_dim);
  comm::check_same_across_ranks(
      shape, group, "torch_mp.context_parallel.all_to_all: [the shape..., split_dim, concat_dim]");
  auto input = at::stack(x.chunk(size, split_dim), 0).contiguous();  // [ranks, part...]
  auto output = at::empty_like(input);
  std::vector<int64_t> equal;
  comm::wait(group->alltoall_base(output, input, equal, equal), group, "all_to_all");
  return at::cat(output.unbind(0), concat_dim);
}

at::Tensor exchange_meta(const at::Tensor& x,
                         int64_t split_dim,
                         int64_t concat_dim,
                         c10::string_view group_name) {
  const int64_t size = group_named(group_name)->getSize();
  auto sizes = x.sym_sizes().vec();
  sizes[c10::maybe_wrap_dim(split_dim, x.dim())] /= size;
  sizes[c10::maybe_wrap_dim(concat_dim, x.dim())] *= size;
  return at::empty_symint(sizes, x.options());
}

using AllToAllSignature = at::Tensor(const at::Tensor&, int64_t, int64_t, c10::string_view);

at::Tensor call_all_to_all(const at::Tensor& x,
                           int64_t split_dim,
                           int64_t concat_dim,
                           const std::string& group) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_mp::all_to_all", "")
                             .typed<AllToAllSignature>();
  return op.call(x, split_dim, concat_dim, group);
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& x,
                            int64_t split_dim,
                            int64_t concat_dim,
                            const std::string& group) {
    ctx->saved_data["split_dim"] = split_dim;
    ctx->saved_data["concat_dim"] = concat_dim;
    ctx->saved_data["group"] = group;
    at::AutoDispatchBelowADInplaceOrView below;
    return call_all_to_all(x, split_dim, concat_dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {call_all_to_all(grads[0],
                            ctx->saved_data.at("concat_dim").toInt(),
                            ctx->saved_data.at("split_dim").toInt(),
                            ctx->saved_data.at("group").toStringRef()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor exchange_autograd(const at::Tensor& x,
                             int64_t split_dim,
                             int64_t concat_dim,
                             c10::string_view group) {
  return AllToAll::apply(x,
                         c10::maybe_wrap_dim(split_dim, x.dim()),
                         c10::maybe_wrap_dim(concat_dim, x.dim()),
                         std::string(group));
}

}  // namespace

at::Tensor all_to_all(const at::Tensor& x,
                      int64_t split_dim,
                      int64_t concat_dim,
                      const GroupPtr& group) {
  return call_all_to_all(x, split_dim, concat_dim, group_name(group));
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def("all_to_all(Tensor x, int split_dim, int concat_dim, str group) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) { m.impl("all_to_all", &exchange_autograd); }

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("all_to_all", &exchange_kernel);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) { m.impl("all_to_all", &exchange_meta); }

}  // namespace torch_mp::context_parallel
