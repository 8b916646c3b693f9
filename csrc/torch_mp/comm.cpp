#include "torch_mp/comm.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/library.h>
#include <torch/version.h>

#include <cstring>
#include <sstream>
#include <string>

#include "torch_mp/agreement.h"

namespace torch_mp::comm {
namespace {

void check_group(const GroupPtr& group) {
  TORCH_CHECK(group, "torch_mp: a collective was given no process group");
}

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

std::vector<std::string> all_gather_text(const std::string& text, const GroupPtr& group) {
  check_group(group);
  const auto device = device_of(group);
  const auto longest =
      all_reduce(at::full({1}, static_cast<int64_t>(text.size()), at::kLong).to(device),
                 group,
                 c10d::ReduceOp::MAX)
          .item<int64_t>();
  if (longest == 0) {  // (the same on every rank)
    return std::vector<std::string>(group->getSize());
  }
  // Each rank's bytes, then its length (8 bytes), in a row of the longest's width.
  const int64_t width = longest + 8;
  auto row = at::zeros({width}, at::kByte);
  auto* bytes = row.data_ptr<uint8_t>();
  std::copy(text.begin(), text.end(), bytes);
  const auto size = static_cast<int64_t>(text.size());
  std::memcpy(bytes + longest, &size, sizeof(size));
  const auto all = all_gather(row.to(device), 0, group).cpu().view({-1, width});
  std::vector<std::string> out;
  for (int64_t r = 0; r < all.size(0); ++r) {
    const auto* mine = all[r].data_ptr<uint8_t>();
    int64_t length = 0;
    std::memcpy(&length, mine + longest, sizeof(length));
    out.emplace_back(reinterpret_cast<const char*>(mine), static_cast<size_t>(length));
  }
  return out;
}

void barrier(const GroupPtr& group) {
  check_group(group);
  wait_for(group->barrier(), group, "barrier");
}

std::map<std::string, at::Tensor> all_gather_named(const std::map<std::string, at::Tensor>& mine,
                                                   const GroupPtr& group) {
  check_group(group);
  // "name\n dtype size... \n" per tensor.
  std::ostringstream described;
  for (const auto& [name, tensor] : mine) {
    TORCH_CHECK(name.find('\n') == std::string::npos, "all_gather_named: a name holds a newline");
    described << name << "\n" << static_cast<int>(tensor.scalar_type());
    for (const auto size : tensor.sizes()) {
      described << " " << size;
    }
    described << "\n";
  }
  const auto device = device_of(group);
  std::map<std::string, at::Tensor> out;
  const auto all = all_gather_text(described.str(), group);
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream lines(all[r]);
    std::string name, shape;
    while (std::getline(lines, name) && std::getline(lines, shape)) {
      std::istringstream fields(shape);
      int dtype = 0;
      fields >> dtype;
      std::vector<int64_t> sizes;
      for (int64_t size = 0; fields >> size;) {
        sizes.push_back(size);
      }
      at::Tensor tensor =
          static_cast<int64_t>(r) == group->getRank()
              ? mine.at(name).detach().to(device).clone(at::MemoryFormat::Contiguous)
              : at::empty(
                    sizes,
                    at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)).device(device));
      std::vector<at::Tensor> tensors{tensor};
      c10d::BroadcastOptions options;
      options.rootRank = static_cast<int64_t>(r);
      wait_for(group->broadcast(tensors, options), group, "all_gather_named");
      out.emplace(name, tensors[0]);  // (the lowest rank's, for a name held twice)
    }
  }
  return out;
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

void all_gather_into(const at::Tensor& output, const at::Tensor& input, const GroupPtr& group) {
  wait_for(start_all_gather_into(output, input, group), group, "all_gather");
}

c10::intrusive_ptr<c10d::Work> start_all_gather_into(const at::Tensor& output,
                                                     const at::Tensor& input,
                                                     const GroupPtr& group) {
  check_group(group);
  const int64_t chunk = input.numel();
  TORCH_CHECK(
      output.dim() == 1 && output.is_contiguous() && output.numel() == chunk * group->getSize(),
      "torch_mp.all_gather_into: the output must be 1-D, contiguous and hold the group's ",
      group->getSize(),
      " inputs of ",
      chunk,
      " elements; got ",
      output.sizes());
  check_operands(input, group, "all_gather");
  at::Tensor flat = input.reshape({-1}).contiguous();
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 14
  // Straight into the output, which may hold the input in place (this rank's range): no
  // gathered copy to unpack, on Gloo as on NCCL.
  at::Tensor out = output;  // (the same tensor; the call takes a mutable reference)
  return group->all_gather_single(out, flat);
#else
  std::vector<at::Tensor> inputs{flat};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < group->getSize(); ++i) {
    outputs[0].push_back(output.narrow(0, i * chunk, chunk));
  }
  return group->allgather(outputs, inputs);
#endif
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

void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupPtr& group, const char* op) {
  wait_for(work, group, op);
}

namespace {
// The P2PGroup open on this thread, if any.
thread_local P2PGroup* open_group = nullptr;
}  // namespace

P2PGroup::P2PGroup(GroupPtr group) : group_(std::move(group)), open_(is_nccl(group_)) {
  if (open_) {
    enclosing_ = open_group;
    open_group = this;
  }
}

P2PGroup::~P2PGroup() {
  if (open_) {  // an exception between the posts: nothing of the group is posted
    open_group = enclosing_;
  }
}

c10::intrusive_ptr<c10d::Work> P2PGroup::finish() {
  if (!open_) {
    return {};
  }
  open_ = false;
  open_group = enclosing_;
  group_->startCoalescing(c10::DeviceType::CUDA);
  try {
    for (auto& op : ops_) {
      std::vector<at::Tensor> one{op.tensor};
      op.send ? group_->send(one, op.peer, op.tag) : group_->recv(one, op.peer, op.tag);
    }
  } catch (...) {
    group_->endCoalescing(c10::DeviceType::CUDA);
    throw;
  }
  for (auto& op : ops_) {
    posted_.push_back(std::move(op.tensor));
  }
  ops_.clear();
  return group_->endCoalescing(c10::DeviceType::CUDA);
}

c10::intrusive_ptr<c10d::Work> P2PGroup::post(
    bool is_send, at::Tensor tensor, int peer, int tag, const GroupPtr& group) {
  if (open_group && open_group->group_ == group) {
    open_group->ops_.push_back({is_send, std::move(tensor), peer, tag});
    return {};
  }
  std::vector<at::Tensor> one{std::move(tensor)};
  return is_send ? group->send(one, peer, tag) : group->recv(one, peer, tag);
}

c10::intrusive_ptr<c10d::Work> send(at::Tensor tensor, int peer, int tag, const GroupPtr& group) {
  return P2PGroup::post(true, std::move(tensor), peer, tag, group);
}

c10::intrusive_ptr<c10d::Work> recv(at::Tensor tensor, int peer, int tag, const GroupPtr& group) {
  return P2PGroup::post(false, std::move(tensor), peer, tag, group);
}

at::Tensor split(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  check_group(group);
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const int64_t chunk = chunk_size(x, dim, group, "split");
  return x.narrow(dim, group->getRank() * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

// ---- the operators ----------------------------------------------------------------------------

namespace {

c10d::ReduceOp reduce_op(c10::string_view name) {
  if (name == "sum") {
    return c10d::ReduceOp::SUM;
  }
  TORCH_CHECK(name == "max", "torch_mp::all_reduce: reduce_op must be 'sum' or 'max', got ", name);
  return c10d::ReduceOp::MAX;
}

at::Tensor all_reduce_op(const at::Tensor& x, c10::string_view op, c10::string_view group) {
  return all_reduce(x, group_named(group), reduce_op(op));
}

at::Tensor all_gather_op(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return all_gather(x, dim, group_named(group));
}

at::Tensor reduce_scatter_op(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return reduce_scatter(x, dim, group_named(group));
}

at::Tensor split_op(const at::Tensor& x, int64_t dim, c10::string_view group) {
  return split(x, dim, group_named(group));
}

// `x`'s shape with dim `dim` multiplied (`grow`) or divided by the group's size, in symbolic
// sizes (torch.compile's dynamic shapes); the real kernels check divisibility.
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

// The library torch_mp: this file defines it; every other file of the core adds its operators
// with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(torch_mp, m) {
  m.def("all_reduce(Tensor x, str reduce_op, str group) -> Tensor");
  m.def("all_gather(Tensor x, int dim, str group) -> Tensor");
  m.def("reduce_scatter(Tensor x, int dim, str group) -> Tensor");
  m.def("split(Tensor x, int dim, str group) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("all_reduce", &all_reduce_op);
  m.impl("all_gather", &all_gather_op);
  m.impl("reduce_scatter", &reduce_scatter_op);
  m.impl("split", &split_op);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("all_reduce", &all_reduce_meta);
  m.impl("all_gather", &all_gather_meta);
  m.impl("reduce_scatter", &chunk_meta);
  m.impl("split", &chunk_meta);
}

}  // namespace torch_mp::comm
