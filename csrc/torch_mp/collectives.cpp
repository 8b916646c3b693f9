#include "torch_mp/collectives.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <sstream>

namespace torch_mp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t chunk_size(const at::Tensor& x, int64_t dim, const GroupPtr& group, const char* op) {
  const int64_t size = x.size(dim);
  TORCH_CHECK(size % group->getSize() == 0,
              "torch_mp.",
              op,
              ": size ",
              size,
              " of dim ",
              dim,
              " is not divisible by the group size (",
              group->getSize(),
              ") on rank ",
              group->getRank());
  return size / group->getSize();
}

void check_group(const GroupPtr& group) {
  TORCH_CHECK(group, "torch_mp: a collective was given no process group");
}

GroupPtr saved_group(AutogradContext* ctx) {
  return ctx->saved_data.at("group").toCustomClass<c10d::ProcessGroup>();
}

int64_t saved_dim(AutogradContext* ctx) { return ctx->saved_data.at("dim").toInt(); }

// Each op below is one autograd Function whose forward and backward are a pair of plain
// collectives from the table in collectives.h.

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const GroupPtr& group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {comm::all_reduce(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const GroupPtr& group) {
    return comm::all_reduce(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// The four ops along a dim differ only in which plain collective runs forward and which
// backward: one Function template serves them all.
using DimCollective = at::Tensor (*)(const at::Tensor&, int64_t, const GroupPtr&);

template <DimCollective Forward, DimCollective Backward>
struct AlongDim : torch::autograd::Function<AlongDim<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& x,
                            const GroupPtr& group,
                            int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return Forward(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(grads[0], saved_dim(ctx), saved_group(ctx)), at::Tensor(), at::Tensor()};
  }
};

using ScatterToTp = AlongDim<&comm::split, &comm::all_gather>;
using GatherFromTp = AlongDim<&comm::all_gather, &comm::split>;
using GatherFromSp = AlongDim<&comm::all_gather, &comm::reduce_scatter>;
using ReduceScatterToSp = AlongDim<&comm::reduce_scatter, &comm::all_gather>;

// Applies a dim-taking op, or returns `x` untouched on a one-rank group.
template <typename Op>
at::Tensor apply_along(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  check_group(group);
  const int64_t wrapped = c10::maybe_wrap_dim(dim, x.dim());
  if (group->getSize() == 1) {
    return x;
  }
  return Op::apply(x, group, wrapped);
}

template <typename Op>
at::Tensor apply(const at::Tensor& x, const GroupPtr& group) {
  check_group(group);
  if (group->getSize() == 1) {
    return x;
  }
  return Op::apply(x, group);
}

}  // namespace

namespace {

std::atomic<bool> collective_checks{[] {
  const char* value = std::getenv("TORCH_MP_CHECK_COLLECTIVES");
  return value != nullptr && std::string(value) == "1";
}()};
// The checks' own all-gathers are not checked again.
thread_local bool inside_check = false;

std::string describe(const at::Tensor& x) {
  std::ostringstream out;
  out << x.scalar_type() << x.sizes();
  return out.str();
}

// Before a collective over `group` on `x`: the ranks' dtypes and shapes must agree.
void check_operands(const at::Tensor& x, const GroupPtr& group, const char* op) {
  if (!collective_checks || inside_check || group->getSize() == 1) {
    return;
  }
  inside_check = true;
  try {
    comm::check_same_text_across_ranks(
        describe(x), group, std::string("torch_mp collective ") + op + ": the tensors");
  } catch (...) {
    inside_check = false;
    throw;
  }
  inside_check = false;
}

}  // namespace

void set_check_collectives(bool on) { collective_checks = on; }

bool check_collectives() { return collective_checks; }

at::Tensor copy_to_tp(const at::Tensor& x, const GroupPtr& group) {
  comm::check_replicated(x, group, "copy_to_tp: its input (replicated over the tensor group)");
  return apply<CopyToTp>(x, group);
}

at::Tensor reduce_from_tp(const at::Tensor& x, const GroupPtr& group) {
  return apply<ReduceFromTp>(x, group);
}

at::Tensor scatter_to_tp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  return apply_along<ScatterToTp>(x, group, dim);
}

at::Tensor gather_from_tp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  return apply_along<GatherFromTp>(x, group, dim);
}

at::Tensor gather_from_sp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  return apply_along<GatherFromSp>(x, group, dim);
}

at::Tensor reduce_scatter_to_sp(const at::Tensor& x, const GroupPtr& group, int64_t dim) {
  return apply_along<ReduceScatterToSp>(x, group, dim);
}

namespace comm {

namespace {

// Waits for a collective, turning Gloo's words for a dead or silent peer into ones that say so.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const GroupPtr& group, const char* op) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    const std::string text = error ? error->what_without_backtrace() : e.what();
    const bool closed = text.find("onnection closed") != std::string::npos ||
                        text.find("closed by peer") != std::string::npos ||
                        text.find("onnection reset") != std::string::npos ||
                        text.find("Broken pipe") != std::string::npos;
    const bool timed_out = text.find("imed out") != std::string::npos;
    if (!closed && !timed_out) {
      throw;
    }
    TORCH_CHECK(false,
                "torch_mp: ",
                op,
                " over a group of ",
                group->getSize(),
                " ranks (this is rank ",
                group->getRank(),
                ") ",
                closed ? "lost a peer's connection: did a peer's process die?"
                       : "got no answer within the group's timeout: a peer stalled, is slow, or "
                         "failed",
                " (",
                text,
                ")");
  }
}

}  // namespace

at::Tensor all_reduce(const at::Tensor& x, const GroupPtr& group, c10d::ReduceOp op) {
  check_group(group);
  check_operands(x, group, "all_reduce");
  std::vector<at::Tensor> tensors{x.clone(at::MemoryFormat::Contiguous)};
  c10d::AllreduceOptions options;
  options.reduceOp = std::move(op);
  wait_for(group->allreduce(tensors, options), group, "all_reduce");
  return tensors[0];
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  check_group(group);
  check_operands(x, group, "all_gather");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  std::vector<at::Tensor> inputs{x.contiguous()};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < group->getSize(); ++i) {
    outputs[0].push_back(at::empty_like(inputs[0]));
  }
  wait_for(group->allgather(outputs, inputs), group, "all_gather");
  return at::cat(outputs[0], dim);
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  check_group(group);
  check_operands(x, group, "reduce_scatter");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  chunk_size(x, dim, group, "reduce_scatter");
  std::vector<std::vector<at::Tensor>> inputs(1);
  for (const auto& chunk : x.chunk(group->getSize(), dim)) {
    inputs[0].push_back(chunk.contiguous());
  }
  std::vector<at::Tensor> outputs{at::empty_like(inputs[0][0])};
  wait_for(group->reduce_scatter(outputs, inputs), group, "reduce_scatter");
  return outputs[0];
}

at::Tensor split(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  check_group(group);
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const int64_t chunk = chunk_size(x, dim, group, "split");
  return x.narrow(dim, group->getRank() * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

namespace {

// Every rank's row of `mine`, or an undefined tensor when all ranks hold the same row.
at::Tensor rows_if_they_differ(const at::Tensor& mine, const GroupPtr& group) {
  const auto all = all_gather(mine.unsqueeze(0), 0, group);
  return all.eq(mine).all().item<bool>() ? at::Tensor() : all;
}

std::string disagreement(const std::string& what, const GroupPtr& group) {
  std::ostringstream msg;
  msg << "torch_mp: " << what << " must be the same on every rank of the group, but ranks "
      << "disagree (seen on rank " << group->getRank() << "):";
  return msg.str();
}

}  // namespace

void check_same_across_ranks(const std::vector<int64_t>& values,
                             const GroupPtr& group,
                             const std::string& what) {
  check_group(group);
  if (group->getSize() == 1) {
    return;
  }
  const auto all = rows_if_they_differ(at::tensor(values, at::kLong), group);
  if (!all.defined()) {
    return;
  }
  std::ostringstream msg;
  msg << disagreement(what, group);
  for (int64_t r = 0; r < all.size(0); ++r) {
    msg << " rank " << r << " has [";
    for (int64_t i = 0; i < all.size(1); ++i) {
      msg << (i ? ", " : "") << all[r][i].item<int64_t>();
    }
    msg << "]" << (r + 1 < all.size(0) ? ";" : "");
  }
  TORCH_CHECK(false, msg.str());
}

void check_same_text_across_ranks(const std::string& text,
                                  const GroupPtr& group,
                                  const std::string& what) {
  check_group(group);
  if (group->getSize() == 1) {
    return;
  }
  constexpr int64_t kQuoted = 200;
  auto mine = at::zeros({kQuoted + 1}, at::kLong);
  auto* out = mine.data_ptr<int64_t>();
  out[0] = static_cast<int64_t>(std::hash<std::string>{}(text) >> 1);
  for (int64_t i = 0; i < kQuoted && i < static_cast<int64_t>(text.size()); ++i) {
    out[i + 1] = static_cast<unsigned char>(text[i]);
  }
  const auto all = rows_if_they_differ(mine, group);
  if (!all.defined()) {
    return;
  }
  std::ostringstream msg;
  msg << disagreement(what, group);
  for (int64_t r = 0; r < all.size(0); ++r) {
    std::string quoted;
    for (int64_t i = 1; i <= kQuoted && all[r][i].item<int64_t>() != 0; ++i) {
      quoted.push_back(static_cast<char>(all[r][i].item<int64_t>()));
    }
    msg << "\n  rank " << r << ": " << quoted;
  }
  TORCH_CHECK(false, msg.str());
}

void check_replicated(const at::Tensor& x, const GroupPtr& group, const std::string& what) {
  if (!collective_checks || inside_check || !group || group->getSize() == 1) {
    return;
  }
  // Replicated tensors are computed alike on every rank: compare their bytes (two checksums).
  const auto bytes = x.detach().contiguous().cpu().view({-1}).view(at::kByte).to(at::kLong);
  const auto position = at::arange(bytes.numel(), at::kLong).remainder(251).add_(1);
  std::ostringstream text;
  text << describe(x) << " values " << bytes.sum().item<int64_t>() << "/"
       << bytes.mul(position).sum().item<int64_t>();
  inside_check = true;
  try {
    check_same_text_across_ranks(text.str(), group, what);
  } catch (...) {
    inside_check = false;
    throw;
  }
  inside_check = false;
}

void check_same_tensors_across_ranks(const std::vector<at::Tensor>& tensors,
                                     const GroupPtr& group,
                                     const std::string& what) {
  std::ostringstream shapes;
  for (const auto& t : tensors) {
    shapes << t.scalar_type() << t.sizes() << ";";
  }
  check_same_across_ranks({static_cast<int64_t>(tensors.size()),
                           static_cast<int64_t>(std::hash<std::string>{}(shapes.str()) >> 1)},
                          group,
                          what + " [count, digest of dtypes and shapes]");
}

}  // namespace comm
}  // namespace torch_mp
