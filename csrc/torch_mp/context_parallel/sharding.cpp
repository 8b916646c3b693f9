// Sequence sharding over a context group (sharding.h).

#include "torch_mp/context_parallel/sharding.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"
#include "torch_mp/mesh.h"

namespace torch_mp::context_parallel {

GroupPtr cp_group_or_default(const GroupPtr& group) { return group ? group : get_mesh()->cp_group; }

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_divisible(int64_t sequence_length, int64_t size, bool load_balance, const char* op) {
  const int64_t chunks = load_balance ? 2 * size : size;
  TORCH_CHECK(sequence_length % chunks == 0,
              "torch_mp.context_parallel.",
              op,
              ": the sequence length (",
              sequence_length,
              ") must be divisible by ",
              load_balance ? "2 * the context-parallel size (" : "the context-parallel size (",
              chunks,
              load_balance ? " chunks: load_balance=True)" : ")");
}

// This rank's part: its chunks of the whole sequence `x` along `dim`.
at::Tensor own_part(const at::Tensor& x, int64_t dim, int64_t rank, int64_t size, bool balanced) {
  const int64_t length = x.size(dim);
  if (!balanced) {
    const int64_t chunk = length / size;
    return x.narrow(dim, rank * chunk, chunk).clone(at::MemoryFormat::Contiguous);  // no alias
  }
  const int64_t chunk = length / (2 * size);
  return at::cat(
      {x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * size - 1 - rank) * chunk, chunk)},
      dim);
}

at::Tensor shard_kernel(const at::Tensor& x,
                        int64_t dim,
                        c10::string_view group_name,
                        bool load_balance) {
  const auto group = group_named(group_name);
  dim = c10::maybe_wrap_dim(dim, x.dim());
  if (group->getSize() > 1) {
    comm::check_same_across_ranks(
        {x.size(dim), dim},
        group,
        "torch_mp.context_parallel.shard_sequence: [sequence length, dim]");
  }
  check_divisible(x.size(dim), group->getSize(), load_balance, "shard_sequence");
  return own_part(x, dim, group->getRank(), group->getSize(), load_balance);
}

at::Tensor unshard_kernel(const at::Tensor& x,
                          int64_t dim,
                          c10::string_view group_name,
                          bool load_balance) {
  const auto group = group_named(group_name);
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const int64_t size = group->getSize();
  TORCH_CHECK(!load_balance || x.size(dim) % 2 == 0,
              "torch_mp.context_parallel.unshard_sequence: a load-balanced part holds two "
              "chunks; its length along dim ",
              dim,
              " (",
              x.size(dim),
              ") is odd");
  const auto gathered = size == 1 ? x : comm::all_gather(x, dim, group);
  const auto order =
      gathered_positions(gathered.size(dim), size, load_balance).argsort().to(x.device());
  return gathered.index_select(dim, order);
}

at::Tensor resized(const at::Tensor& x, int64_t dim, c10::string_view group_name, bool grow) {
  const int64_t size = group_named(group_name)->getSize();
  auto sizes = x.sym_sizes().vec();
  dim = c10::maybe_wrap_dim(dim, x.dim());
  sizes[dim] = grow ? sizes[dim] * size : sizes[dim] / size;
  return at::empty_symint(sizes, x.options());
}

at::Tensor shard_meta(const at::Tensor& x, int64_t dim, c10::string_view group, bool) {
  return resized(x, dim, group, /*grow=*/false);
}

at::Tensor unshard_meta(const at::Tensor& x, int64_t dim, c10::string_view group, bool) {
  return resized(x, dim, group, /*grow=*/true);
}

using SequenceSignature = at::Tensor(const at::Tensor&, int64_t, c10::string_view, bool);

at::Tensor call_sequence_op(const char* name,
                            const at::Tensor& x,
                            int64_t dim,
                            const std::string& group,
                            bool load_balance) {
  const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<SequenceSignature>();
  return op.call(x, dim, group, load_balance);
}

// The backwards are the adjoints of the cut and of the join, the context ranks holding
// different parts of the data (not copies of one computation): a part's gradient goes back
// into its place in a tensor of zeros, and the whole's gradients of every rank are summed into
// each rank's part (reduce-scatter). So a model's replicated parameters, their gradients
// averaged over data x context ranks (DataParallel), get the one-process gradients whether a
// rank's loss is over its own tokens or over the joined sequence.
struct ShardFunction : torch::autograd::Function<ShardFunction> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& x,
                            const std::string& group,
                            int64_t dim,
                            bool load_balance) {
    at::Tensor part;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      part = call_sequence_op("torch_mp::shard_sequence", x, dim, group, load_balance);
    }
    const auto g = group_named(group);  // (the op has checked the length on every rank)
    ctx->saved_data["positions"] =
        sequence_positions(x.size(dim), g->getRank(), g->getSize(), load_balance);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["length"] = x.size(dim);
    return part;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto dim = ctx->saved_data.at("dim").toInt();
    const auto positions = ctx->saved_data.at("positions").toTensor().to(grads[0].device());
    auto sizes = grads[0].sizes().vec();
    sizes[dim] = ctx->saved_data.at("length").toInt();
    auto whole = at::zeros(sizes, grads[0].options()).index_copy(dim, positions, grads[0]);
    return {whole, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct UnshardFunction : torch::autograd::Function<UnshardFunction> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& x,
                            const std::string& group,
                            int64_t dim,
                            bool load_balance) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["load_balance"] = load_balance;
    at::AutoDispatchBelowADInplaceOrView below;
    return call_sequence_op("torch_mp::unshard_sequence", x, dim, group, load_balance);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    using ReduceScatter = at::Tensor(const at::Tensor&, int64_t, c10::string_view);
    static const auto reduce_scatter = c10::Dispatcher::singleton()
                                           .findSchemaOrThrow("torch_mp::reduce_scatter", "")
                                           .typed<ReduceScatter>();
    const auto group = ctx->saved_data.at("group").toStringRef();
    const auto dim = ctx->saved_data.at("dim").toInt();
    const int64_t size = group_named(group)->getSize();
    const auto order =
        gathered_positions(grads[0].size(dim), size, ctx->saved_data.at("load_balance").toBool())
            .to(grads[0].device());
    auto grad = grads[0].index_select(dim, order);  // the parts one after the other
    if (size > 1) {
      grad = reduce_scatter.call(grad, dim, group);
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

template <typename Function>
at::Tensor autograd_kernel(const at::Tensor& x,
                           int64_t dim,
                           c10::string_view group,
                           bool load_balance) {
  return Function::apply(x, std::string(group), c10::maybe_wrap_dim(dim, x.dim()), load_balance);
}

}  // namespace

at::Tensor sequence_positions(int64_t sequence_length,
                              int64_t rank,
                              int64_t size,
                              bool load_balance) {
  check_divisible(sequence_length, size, load_balance, "sequence_positions");
  TORCH_CHECK(rank >= 0 && rank < size,
              "torch_mp.context_parallel.sequence_positions: rank ",
              rank,
              " is outside a context group of ",
              size);
  return own_part(at::arange(sequence_length, at::kLong), 0, rank, size, load_balance);
}

at::Tensor gathered_positions(int64_t sequence_length, int64_t size, bool load_balance) {
  std::vector<at::Tensor> parts;
  for (int64_t rank = 0; rank < size; ++rank) {
    parts.push_back(sequence_positions(sequence_length, rank, size, load_balance));
  }
  return at::cat(parts);
}

at::Tensor shard_sequence(const at::Tensor& x,
                          int64_t dim,
                          const GroupPtr& group,
                          bool load_balance) {
  return call_sequence_op("torch_mp::shard_sequence", x, dim, group_name(group), load_balance);
}

at::Tensor unshard_sequence(const at::Tensor& x,
                            int64_t dim,
                            const GroupPtr& group,
                            bool load_balance) {
  return call_sequence_op("torch_mp::unshard_sequence", x, dim, group_name(group), load_balance);
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def("shard_sequence(Tensor x, int dim, str group, bool load_balance=True) -> Tensor");
  m.def("unshard_sequence(Tensor x, int dim, str group, bool load_balance=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) {
  m.impl("shard_sequence", &autograd_kernel<ShardFunction>);
  m.impl("unshard_sequence", &autograd_kernel<UnshardFunction>);
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("shard_sequence", &shard_kernel);
  m.impl("unshard_sequence", &unshard_kernel);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("shard_sequence", &shard_meta);
  m.impl("unshard_sequence", &unshard_meta);
}

}  // namespace torch_mp::context_parallel
