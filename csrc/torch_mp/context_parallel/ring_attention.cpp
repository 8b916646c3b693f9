// The ring method of context-parallel attention (attention_methods.h): K/V blocks passed around
// the ring, partial outputs merged by their log-sum-exp, a second ring carrying dK/dV home in
// the backward; its operators' kernels, meta kernels, autograd and registration.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torch_mp/comm.h"
#include "torch_mp/context_parallel/attention_methods.h"

namespace torch_mp::context_parallel::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- the ring ---------------------------------------------------------------------------------

// A chunk of a rank's part: its rows [offset, offset + length) hold the whole sequence's
// positions [first, first + length).
struct Chunk {
  int64_t offset, length, first;
};

std::vector<Chunk> chunks_of(int64_t rank, int64_t size, int64_t local, bool load_balance) {
  if (!load_balance) {
    return {{0, local, rank * local}};
  }
  const int64_t half = local / 2;
  return {{0, half, rank * half}, {half, half, (2 * size - 1 - rank) * half}};
}

// How a block of queries meets a block of keys under a causal mask: chunks are aligned and of
// one length, so keys are wholly before the queries, wholly after, or the same positions.
enum class Meeting { kAll, kNone, kDiagonal };

Meeting meeting(const Chunk& queries, const Chunk& keys, bool is_causal) {
  if (!is_causal || keys.first < queries.first) {
    return Meeting::kAll;
  }
  return keys.first > queries.first ? Meeting::kNone : Meeting::kDiagonal;
}

at::Tensor repeat_heads(const at::Tensor& kv, int64_t heads) {
  return kv.size(1) == heads ? kv : kv.repeat_interleave(heads / kv.size(1), 1);
}

at::Tensor sum_heads(const at::Tensor& grad, int64_t kv_heads) {
  if (grad.size(1) == kv_heads) {
    return grad;
  }
  auto sizes = grad.sizes().vec();
  sizes[1] = kv_heads;
  sizes.insert(sizes.begin() + 2, grad.size(1) / kv_heads);
  return grad.reshape(sizes).sum(2);
}

// The scores of `q` against `k` (heads repeated), the future masked out on the diagonal.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, double scale, Meeting how) {
  auto s = at::matmul(q, repeat_heads(k, q.size(1)).transpose(-2, -1)) * scale;
  if (how == Meeting::kDiagonal) {
    const auto future = at::ones({s.size(-2), s.size(-1)}, s.options().dtype(at::kBool)).triu(1);
    s.masked_fill_(future, -std::numeric_limits<double>::infinity());
  }
  return s;
}

// CPU's fused attention kernel (flash attention for CPU) serves a block where it can: it never
// holds the block's scores whole, and returns the log-sum-exp the merge needs; elsewhere the
// block's scores are made explicitly.
// The dtype the ring accumulates outputs, log-sum-exps and gradients in: at least float.
at::ScalarType accumulation_dtype(const at::Tensor& q) {
  return at::promote_types(q.scalar_type(), at::kFloat);
}

bool fused_block(const at::Tensor& q) {
  return q.is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                        q.scalar_type() == at::kHalf);
}

// A block's output and log-sum-exp (float), of queries `q` against keys `k` and values `v`.
std::pair<at::Tensor, at::Tensor> block_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, Meeting how) {
  const auto keys = repeat_heads(k, q.size(1));
  const auto values = repeat_heads(v, q.size(1));
  if (fused_block(q)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.contiguous(),
                                                                      keys.contiguous(),
                                                                      values.contiguous(),
                                                                      0.0,
                                                                      how == Meeting::kDiagonal,
                                                                      std::nullopt,
                                                                      scale);
    return {out, lse.to(accumulation_dtype(q))};
  }
  const auto s = scores(q.to(accumulation_dtype(q)), k.to(accumulation_dtype(q)), scale, how);
  const auto lse = at::logsumexp(s, -1);
  return {at::matmul(at::exp(s - lse.unsqueeze(-1)), values.to(s.scalar_type())), lse};
}

// A block's gradients (dq, and dk, dv for every query head), from the whole output `out`, its
// log-sum-exp `lse` and `delta` = rowsum(grad_out * out).
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& grad_out,
                                                              const at::Tensor& q,
                                                              const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              const at::Tensor& out,
                                                              const at::Tensor& lse,
                                                              const at::Tensor& delta,
                                                              double scale,
                                                              Meeting how) {
  const auto keys = repeat_heads(k, q.size(1));
  const auto values = repeat_heads(v, q.size(1));
  if (fused_block(q)) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out.contiguous(),
                                                                    q.contiguous(),
                                                                    keys.contiguous(),
                                                                    values.contiguous(),
                                                                    out.contiguous(),
                                                                    lse.contiguous(),
                                                                    0.0,
                                                                    how == Meeting::kDiagonal,
                                                                    std::nullopt,
                                                                    scale);
  }
  const auto wide = [&](const at::Tensor& t) { return t.to(lse.scalar_type()); };
  const auto p = at::exp(scores(wide(q), wide(k), scale, how) - lse.unsqueeze(-1));
  const auto dp = at::matmul(wide(grad_out), wide(values).transpose(-2, -1));
  const auto ds = p * (dp - delta.unsqueeze(-1));
  return {at::matmul(ds, wide(keys)) * scale,
          at::matmul(ds.transpose(-2, -1), wide(q)) * scale,
          at::matmul(p.transpose(-2, -1), wide(grad_out))};
}

// The ring's neighbours and its exchange of one tensor: sent to the next rank, received from
// the previous one, posted together (one NCCL group, comm::P2PGroup: at two ranks the next is
// the previous, and two sends to each other must not wait behind one another) before the caller
// computes, and waited for after. NCCL runs the pair on its own stream, so the exchange overlaps
// the block's compute there as on Gloo.
struct Ring {
  GroupPtr group;
  int64_t rank, size;

  struct Transfer {
    c10::intrusive_ptr<c10d::Work> send, recv;
    at::Tensor received;
  };

  Transfer pass(const at::Tensor& tensor, int tag) const {
    Transfer t;
    t.received = at::empty_like(tensor);
    comm::check_device(tensor, group, "context_parallel ring send");
    comm::P2PGroup batch(group);
    t.send = comm::send(tensor, static_cast<int>((rank + 1) % size), tag, group);
    t.recv = comm::recv(t.received, static_cast<int>((rank + size - 1) % size), tag, group);
    batch.end(t.send, t.recv);
    return t;
  }

  at::Tensor finish(Transfer& t) const {
    RECORD_FUNCTION("torch_mp::ring_attention wait", std::vector<c10::IValue>());
    comm::wait(t.send, group, "context_parallel ring send");
    comm::wait(t.recv, group, "context_parallel ring receive");
    return t.received;
  }
};

constexpr int kKeysValuesTag = 0x6b76;        // "kv"
constexpr int kKeysValuesGradTag = 0x646b76;  // "dkv"

// Calls block(queries, keys, how) for every pair of this rank's query chunks and the chunks of the
// key-value block that arrives at `step`, where they meet (none, all, or on the diagonal).
template <typename Block>
void for_each_meeting(
    const Ring& r, int64_t step, int64_t local, bool is_causal, bool load_balance, Block&& block) {
  const bool balanced = load_balance && is_causal;
  const int64_t source = (r.rank - step + r.size) % r.size;
  RECORD_FUNCTION("torch_mp::ring_attention compute", std::vector<c10::IValue>());
  for (const auto& qc : chunks_of(r.rank, r.size, local, balanced)) {
    for (const auto& kc : chunks_of(source, r.size, local, balanced)) {
      const Meeting how = meeting(qc, kc, is_causal);
      if (how != Meeting::kNone) {
        block(qc, kc, how);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> ring_forward_kernel(const at::Tensor& q,
                                                       const at::Tensor& k,
                                                       const at::Tensor& v,
                                                       c10::string_view group_name,
                                                       bool is_causal,
                                                       double scale,
                                                       bool load_balance) {
  const auto group = group_named(group_name);
  const Ring r{group, group->getRank(), group->getSize()};
  check_parts(q, k, v, r.group, AttentionOptions().is_causal(is_causal).load_balance(load_balance));
  const int64_t batch = q.size(0), local = q.size(2);
  const auto accumulate = q.options().dtype(accumulation_dtype(q));
  auto out = at::zeros(q.sizes(), accumulate);
  auto lse =
      at::full({batch, q.size(1), local}, -std::numeric_limits<double>::infinity(), accumulate);
  auto keys_values = at::cat({k, v}, 0).contiguous();  // [2b, kv heads, local, d]
  for (int64_t step = 0; step < r.size; ++step) {
    std::optional<Ring::Transfer> next;
    if (step + 1 < r.size) {
      next = r.pass(keys_values, kKeysValuesTag);  // overlapped with this block's compute
    }
    const auto keys = keys_values.narrow(0, 0, batch);
    const auto values = keys_values.narrow(0, batch, batch);
    for_each_meeting(r,
                     step,
                     local,
                     is_causal,
                     load_balance,
                     [&](const Chunk& qc, const Chunk& kc, Meeting how) {
                       const auto [block_out, block_lse] =
                           block_forward(q.narrow(2, qc.offset, qc.length),
                                         keys.narrow(2, kc.offset, kc.length),
                                         values.narrow(2, kc.offset, kc.length),
                                         scale,
                                         how);
                       auto o = out.narrow(2, qc.offset, qc.length);
                       auto l = lse.narrow(2, qc.offset, qc.length);
                       const auto merged = at::logaddexp(l, block_lse);
                       o.copy_(o * at::exp(l - merged).unsqueeze(-1) +
                               block_out * at::exp(block_lse - merged).unsqueeze(-1));
                       l.copy_(merged);
                     });
    if (next) {
      keys_values = r.finish(*next);
    }
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward_kernel(const at::Tensor& grad_out,
                                                                    const at::Tensor& q,
                                                                    const at::Tensor& k,
                                                                    const at::Tensor& v,
                                                                    const at::Tensor& out,
                                                                    const at::Tensor& lse,
                                                                    c10::string_view group_name,
                                                                    bool is_causal,
                                                                    double scale,
                                                                    bool load_balance) {
  const auto group = group_named(group_name);
  const Ring r{group, group->getRank(), group->getSize()};
  const int64_t batch = q.size(0), local = q.size(2), kv_heads = k.size(1);
  const auto dout = grad_out.contiguous();
  // rowsum(grad_out * out), which the explicit blocks need (the fused kernel makes its own).
  const auto delta = fused_block(q)
                         ? at::Tensor()
                         : (dout.to(accumulation_dtype(q)) * out.to(accumulation_dtype(q))).sum(-1);
  const auto accumulate = q.options().dtype(accumulation_dtype(q));
  auto dq = at::zeros(q.sizes(), accumulate);
  auto keys_values = at::cat({k, v}, 0).contiguous();
  auto grads = at::zeros(keys_values.sizes(), accumulate);  // the travelling block's dK, dV
  for (int64_t step = 0; step < r.size; ++step) {
    std::optional<Ring::Transfer> next;
    if (step + 1 < r.size) {
      next = r.pass(keys_values, kKeysValuesTag);
    }
    const auto keys = keys_values.narrow(0, 0, batch);
    const auto values = keys_values.narrow(0, batch, batch);
    auto dk = grads.narrow(0, 0, batch);
    auto dv = grads.narrow(0, batch, batch);
    for_each_meeting(
        r,
        step,
        local,
        is_causal,
        load_balance,
        [&](const Chunk& qc, const Chunk& kc, Meeting how) {
          const auto rows = [&](const at::Tensor& t) { return t.narrow(2, qc.offset, qc.length); };
          const auto [dq_c, dk_c, dv_c] = block_backward(rows(dout),
                                                         rows(q),
                                                         keys.narrow(2, kc.offset, kc.length),
                                                         values.narrow(2, kc.offset, kc.length),
                                                         rows(out),
                                                         rows(lse),
                                                         delta.defined() ? rows(delta) : delta,
                                                         scale,
                                                         how);
          dq.narrow(2, qc.offset, qc.length).add_(dq_c);
          dk.narrow(2, kc.offset, kc.length).add_(sum_heads(dk_c, kv_heads));
          dv.narrow(2, kc.offset, kc.length).add_(sum_heads(dv_c, kv_heads));
        });
    if (r.size > 1) {
      // The block's gradients go on with it: after the last step they reach its owner.
      auto home = r.pass(grads, kKeysValuesGradTag);
      grads = r.finish(home);
    }
    if (next) {
      keys_values = r.finish(*next);
    }
  }
  return {dq.to(q.scalar_type()),
          grads.narrow(0, 0, batch).to(k.scalar_type()),
          grads.narrow(0, batch, batch).to(v.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> ring_forward_meta(const at::Tensor& q,
                                                     const at::Tensor&,
                                                     const at::Tensor&,
                                                     c10::string_view,
                                                     bool,
                                                     double,
                                                     bool) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)},
                           q.options().dtype(accumulation_dtype(q)))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward_meta(const at::Tensor&,
                                                                  const at::Tensor& q,
                                                                  const at::Tensor& k,
                                                                  const at::Tensor& v,
                                                                  const at::Tensor&,
                                                                  const at::Tensor&,
                                                                  c10::string_view,
                                                                  bool,
                                                                  double,
                                                                  bool) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty_like(k, at::MemoryFormat::Contiguous),
          at::empty_like(v, at::MemoryFormat::Contiguous)};
}

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, bool, double, bool);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                         const at::Tensor&,
                                                                         const at::Tensor&,
                                                                         const at::Tensor&,
                                                                         const at::Tensor&,
                                                                         const at::Tensor&,
                                                                         c10::string_view,
                                                                         bool,
                                                                         double,
                                                                         bool);

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& q,
                            const at::Tensor& k,
                            const at::Tensor& v,
                            const std::string& group,
                            bool is_causal,
                            double scale,
                            bool load_balance) {
    static const auto op = op_named<ForwardSignature>("torch_mp::ring_attention_forward");
    at::Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(out, lse) = op.call(q, k, v, group, is_causal, scale, load_balance);
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["group"] = group;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["load_balance"] = load_balance;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_named<BackwardSignature>("torch_mp::ring_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const auto [dq, dk, dv] = op.call(grads[0],
                                      saved[0],
                                      saved[1],
                                      saved[2],
                                      saved[3],
                                      saved[4],
                                      ctx->saved_data.at("group").toStringRef(),
                                      ctx->saved_data.at("is_causal").toBool(),
                                      ctx->saved_data.at("scale").toDouble(),
                                      ctx->saved_data.at("load_balance").toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor ring_autograd(const at::Tensor& q,
                         const at::Tensor& k,
                         const at::Tensor& v,
                         c10::string_view group,
                         bool is_causal,
                         double scale,
                         bool load_balance) {
  return RingAttention::apply(q, k, v, std::string(group), is_causal, scale, load_balance);
}

at::Tensor ring_inference(const at::Tensor& q,
                          const at::Tensor& k,
                          const at::Tensor& v,
                          c10::string_view group,
                          bool is_causal,
                          double scale,
                          bool load_balance) {
  static const auto op = op_named<ForwardSignature>("torch_mp::ring_attention_forward");
  return std::get<0>(op.call(q, k, v, group, is_causal, scale, load_balance));
}

}  // namespace

at::Tensor ring_attention(const at::Tensor& q,
                          const at::Tensor& k,
                          const at::Tensor& v,
                          const GroupPtr& group,
                          const AttentionOptions& options) {
  TORCH_CHECK(!options.attn_mask() || !options.attn_mask()->defined(),
              kWhat,
              "(method='ring'): the ring takes is_causal, not an attn_mask; use "
              "method='all_gather' or 'all_to_all' for other masks");
  using Signature = at::Tensor(const at::Tensor&,
                               const at::Tensor&,
                               const at::Tensor&,
                               c10::string_view,
                               bool,
                               double,
                               bool);
  static const auto op = op_named<Signature>("torch_mp::ring_attention");
  return op.call(q,
                 k,
                 v,
                 group_name(group),
                 options.is_causal(),
                 scale_of(q, options),
                 options.load_balance());
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def(
      "ring_attention(Tensor q, Tensor k, Tensor v, str group, bool is_causal, float scale, "
      "bool load_balance) -> Tensor");
  m.def(
      "ring_attention_forward(Tensor q, Tensor k, Tensor v, str group, bool is_causal, "
      "float scale, bool load_balance) -> (Tensor, Tensor)");
  m.def(
      "ring_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, str group, bool is_causal, float scale, bool load_balance) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) { m.impl("ring_attention", &ring_autograd); }

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("ring_attention", &ring_inference);
  m.impl("ring_attention_forward", &ring_forward_kernel);
  m.impl("ring_attention_backward", &ring_backward_kernel);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("ring_attention_forward", &ring_forward_meta);
  m.impl("ring_attention_backward", &ring_backward_meta);
}

}  // namespace torch_mp::context_parallel::detail
