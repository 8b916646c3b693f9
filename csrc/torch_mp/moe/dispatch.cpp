// All-to-all with variable splits (dispatch.h).

#include "torch_mp/moe/dispatch.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <numeric>
#include <string>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"

namespace torch_mp::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kWhat = "torch_mp.moe.all_to_all_rows";

int64_t total(c10::IntArrayRef counts) {
  return std::accumulate(counts.begin(), counts.end(), int64_t{0});
}

at::Tensor rows_kernel(const at::Tensor& x,
                       c10::IntArrayRef send_counts,
                       c10::IntArrayRef recv_counts,
                       c10::string_view group_name) {
  const auto group = group_named(group_name);
  const auto size = static_cast<size_t>(group->getSize());
  TORCH_CHECK(x.dim() >= 1 && send_counts.size() == size && recv_counts.size() == size &&
                  total(send_counts) == x.size(0),
              kWhat,
              ": rank ",
              group->getRank(),
              " has ",
              x.dim() >= 1 ? x.size(0) : 0,
              " rows to send by counts ",
              send_counts,
              " over ",
              size,
              " ranks");
  auto shape = x.sizes().vec();
  shape[0] = total(recv_counts);
  auto output = at::empty(shape, x.options());
  if (size == 1) {
    return output.copy_(x);
  }
  comm::check_device(x, group, "all_to_all_rows");
  auto input = x.contiguous();
  auto output_splits = recv_counts.vec();
  auto input_splits = send_counts.vec();
  comm::wait(
      group->alltoall_base(output, input, output_splits, input_splits), group, "all_to_all_rows");
  return output;
}

at::Tensor rows_meta(const at::Tensor& x,
                     c10::IntArrayRef,
                     c10::IntArrayRef recv_counts,
                     c10::string_view) {
  auto shape = x.sizes().vec();
  shape[0] = total(recv_counts);
  return at::empty(shape, x.options());
}

using RowsSignature = at::Tensor(const at::Tensor&,
                                 c10::IntArrayRef,
                                 c10::IntArrayRef,
                                 c10::string_view);

at::Tensor call_rows(const at::Tensor& x,
                     c10::IntArrayRef send_counts,
                     c10::IntArrayRef recv_counts,
                     const std::string& group) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_mp::all_to_all_rows", "")
                             .typed<RowsSignature>();
  return op.call(x, send_counts, recv_counts, group);
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& x,
                            const std::vector<int64_t>& send_counts,
                            const std::vector<int64_t>& recv_counts,
                            const std::string& group) {
    ctx->saved_data["send_counts"] = send_counts;
    ctx->saved_data["recv_counts"] = recv_counts;
    ctx->saved_data["group"] = group;
    at::AutoDispatchBelowADInplaceOrView below;
    return call_rows(x, send_counts, recv_counts, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {call_rows(grads[0],
                      ctx->saved_data.at("recv_counts").toIntVector(),
                      ctx->saved_data.at("send_counts").toIntVector(),
                      ctx->saved_data.at("group").toStringRef()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor rows_autograd(const at::Tensor& x,
                         c10::IntArrayRef send_counts,
                         c10::IntArrayRef recv_counts,
                         c10::string_view group) {
  return AllToAllRows::apply(x, send_counts.vec(), recv_counts.vec(), std::string(group));
}

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& x,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts,
                           const GroupPtr& group) {
  return call_rows(x, send_counts, recv_counts, group_name(group));
}

at::Tensor exchange_counts(const at::Tensor& counts, const GroupPtr& group) {
  const int64_t size = group->getSize();
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == size && counts.scalar_type() == at::kLong,
              "torch_mp.moe.exchange_counts: counts must be int64 [ranks = ",
              size,
              ", m], got ",
              counts.sizes());
  if (size == 1) {
    return counts.clone();
  }
  comm::check_device(counts, group, "exchange_counts");
  comm::check_same_across_ranks({counts.size(1)}, group, "torch_mp.moe: the counts per rank");
  auto input = counts.contiguous();
  auto output = at::empty_like(input);
  std::vector<int64_t> equal;
  comm::wait(group->alltoall_base(output, input, equal, equal), group, "exchange_counts");
  return output;
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def("all_to_all_rows(Tensor x, int[] send_counts, int[] recv_counts, str group) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) { m.impl("all_to_all_rows", &rows_autograd); }

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("all_to_all_rows", &rows_kernel);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) { m.impl("all_to_all_rows", &rows_meta); }

}  // namespace torch_mp::moe
