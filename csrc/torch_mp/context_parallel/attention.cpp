// Attention over a sequence split across a context group (attention.h).

#include "torch_mp/context_parallel/attention.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "torch_mp/agreement.h"
#include "torch_mp/collectives.h"
#include "torch_mp/comm.h"
#include "torch_mp/context_parallel/all_to_all.h"
#include "torch_mp/context_parallel/sharding.h"

namespace torch_mp::context_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kWhat = "torch_mp.context_parallel.attention";

// ---- masks for all_gather and all_to_all -----------------------------------------------------

// The mask of queries at positions `rows` and keys at `cols` (of the whole sequence): the
// causal one and the user's, combined as scaled_dot_product_attention takes them; nullopt for
// none. `heads` narrows a mask with a heads dim to [first, first + count).
std::optional<at::Tensor> mask_for(const at::Tensor& rows,
                                   const at::Tensor& cols,
                                   bool is_causal,
                                   const std::optional<at::Tensor>& attn_mask,
                                   int64_t first_head,
                                   int64_t heads,
                                   int64_t all_heads) {
  std::optional<at::Tensor> mask;
  if (attn_mask && attn_mask->defined()) {
    auto m = *attn_mask;
    TORCH_CHECK(m.dim() >= 2, kWhat, ": attn_mask must have at least 2 dims, got ", m.sizes());
    if (m.size(-2) != 1) {
      m = m.index_select(-2, rows.to(m.device()));
    }
    if (m.size(-1) != 1) {
      m = m.index_select(-1, cols.to(m.device()));
    }
    if (m.dim() >= 3 && m.size(-3) == all_heads && heads != all_heads) {
      m = m.narrow(-3, first_head, heads);
    }
    mask = m;
  }
  if (!is_causal) {
    return mask;
  }
  const auto causal = rows.unsqueeze(1) >= cols.unsqueeze(0);
  if (!mask) {
    return causal;
  }
  if (mask->scalar_type() == at::kBool) {
    return at::logical_and(*mask, causal);
  }
  return mask->masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity());
}

at::Tensor sdpa(const at::Tensor& q,
                const at::Tensor& k,
                const at::Tensor& v,
                const std::optional<at::Tensor>& mask,
                double scale) {
  return at::scaled_dot_product_attention(
      q, k, v, mask, 0.0, /*is_causal=*/false, scale, /*enable_gqa=*/k.size(1) != q.size(1));
}

// The parts' shapes, and the same on every rank (a rank with another length would leave the
// others' collectives waiting, or mix parts of different sequences).
void check_parts(const at::Tensor& q,
                 const at::Tensor& k,
                 const at::Tensor& v,
                 const GroupPtr& group,
                 bool is_causal,
                 bool load_balance) {
  // Agreed before anything is refused: a rank that refused alone would leave the others waiting.
  if (group->getSize() > 1) {
    std::vector<int64_t> shapes{is_causal, load_balance};
    for (const auto* t : {&q, &k, &v}) {
      shapes.push_back(t->dim());
      for (int64_t d = 0; d < 4; ++d) {
        shapes.push_back(d < t->dim() ? t->size(d) : -1);
      }
    }
    comm::check_same_across_ranks(shapes,
                                  group,
                                  std::string(kWhat) +
                                      " [is_causal, load_balance, then q's, k's and v's dims and "
                                      "sizes: batch, heads, sequence part, head dim]");
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              kWhat,
              ": q, k and v must be [batch, heads, sequence part, head dim], got ",
              q.sizes(),
              ", ",
              k.sizes(),
              ", ",
              v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  k.size(3) == q.size(3) && q.size(1) % k.size(1) == 0,
              kWhat,
              ": k and v must match q but for fewer heads that divide q's, got q ",
              q.sizes(),
              ", k ",
              k.sizes(),
              ", v ",
              v.sizes());
  TORCH_CHECK(!(is_causal && load_balance) || q.size(2) % 2 == 0,
              kWhat,
              ": a load-balanced part holds two chunks; its length (",
              q.size(2),
              ") is odd");
}

// The positions this rank's part holds (sequence_positions), once check_parts has agreed the
// parts' shapes: the operator torch_mp::context_part_positions, whose kernel runs the check.
at::Tensor checked_positions(const at::Tensor& q,
                             const at::Tensor& k,
                             const at::Tensor& v,
                             const GroupPtr& group,
                             bool is_causal,
                             bool load_balance);

at::Tensor all_gather_attention(const at::Tensor& q,
                                const at::Tensor& k,
                                const at::Tensor& v,
                                const GroupPtr& group,
                                bool is_causal,
                                double scale,
                                bool load_balance,
                                const std::optional<at::Tensor>& attn_mask) {
  const int64_t size = group->getSize();
  const int64_t s = q.size(2) * size;
  // The parts' shapes agreed before the gathers (a rank with another length would leave them
  // waiting), by an operator so that compiled code checks them too.
  const auto rows = checked_positions(q, k, v, group, is_causal, load_balance);
  // Gathered K/V: the gradient of each rank's queries' use of them is summed (reduce-scatter).
  const auto keys = gather_from_sp(k, group, 2);
  const auto values = gather_from_sp(v, group, 2);
  const auto cols = gathered_positions(s, size, load_balance).to(q.device());
  const auto mask = mask_for(rows, cols, is_causal, attn_mask, 0, q.size(1), q.size(1));
  return sdpa(q, keys, values, mask, scale);
}

at::Tensor all_to_all_attention(const at::Tensor& q,
                                const at::Tensor& k,
                                const at::Tensor& v,
                                const GroupPtr& group,
                                bool is_causal,
                                double scale,
                                bool load_balance,
                                const std::optional<at::Tensor>& attn_mask) {
  const int64_t size = group->getSize();
  TORCH_CHECK(q.size(1) % size == 0 && k.size(1) % size == 0,
              kWhat,
              "(method='all_to_all'): the heads (",
              q.size(1),
              ") and key/value heads (",
              k.size(1),
              ") must be divisible by the context-parallel size (",
              size,
              "); use method='ring' or 'all_gather'");
  // Sequence-sharded [b, h, s/cp, d] -> head-sharded [b, h/cp, s, d], the sequence in the
  // gathered order (rank 0's part, then rank 1's...).
  const auto heads_q = all_to_all(q, 1, 2, group);
  const auto heads_k = all_to_all(k, 1, 2, group);
  const auto heads_v = all_to_all(v, 1, 2, group);
  const int64_t s = q.size(2) * size;
  const auto order = gathered_positions(s, size, load_balance).to(q.device());
  if (is_causal && (!attn_mask || !attn_mask->defined())) {
    // In the sequence's own order the causal mask is SDPA's, which skips the future's half.
    const auto natural = order.argsort();
    const auto out = at::scaled_dot_product_attention(heads_q.index_select(2, natural),
                                                      heads_k.index_select(2, natural),
                                                      heads_v.index_select(2, natural),
                                                      std::nullopt,
                                                      0.0,
                                                      /*is_causal=*/true,
                                                      scale,
                                                      /*enable_gqa=*/k.size(1) != q.size(1));
    return all_to_all(out.index_select(2, order), 2, 1, group);
  }
  const int64_t heads = q.size(1) / size;
  const auto mask =
      mask_for(order, order, is_causal, attn_mask, group->getRank() * heads, heads, q.size(1));
  return all_to_all(sdpa(heads_q, heads_k, heads_v, mask, scale), 2, 1, group);
}

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

std::tuple<at::Tensor, at::Tensor> ring_forward_kernel(const at::Tensor& q,
                                                       const at::Tensor& k,
                                                       const at::Tensor& v,
                                                       c10::string_view group_name,
                                                       bool is_causal,
                                                       double scale,
                                                       bool load_balance) {
  const auto group = group_named(group_name);
  const Ring r{group, group->getRank(), group->getSize()};
  check_parts(q, k, v, r.group, is_causal, load_balance);
  const int64_t batch = q.size(0), local = q.size(2);
  const auto accumulate = q.options().dtype(accumulation_dtype(q));
  auto out = at::zeros(q.sizes(), accumulate);
  auto lse =
      at::full({batch, q.size(1), local}, -std::numeric_limits<double>::infinity(), accumulate);
  const auto mine = chunks_of(r.rank, r.size, local, load_balance && is_causal);
  auto keys_values = at::cat({k, v}, 0).contiguous();  // [2b, kv heads, local, d]
  for (int64_t step = 0; step < r.size; ++step) {
    const int64_t source = (r.rank - step + r.size) % r.size;
    std::optional<Ring::Transfer> next;
    if (step + 1 < r.size) {
      next = r.pass(keys_values, kKeysValuesTag);  // overlapped with this block's compute
    }
    const auto keys = keys_values.narrow(0, 0, batch);
    const auto values = keys_values.narrow(0, batch, batch);
    {  // (the profiler's range of the block's compute)
      RECORD_FUNCTION("torch_mp::ring_attention compute", std::vector<c10::IValue>());
      for (const auto& qc : mine) {
        for (const auto& kc : chunks_of(source, r.size, local, load_balance && is_causal)) {
          const Meeting how = meeting(qc, kc, is_causal);
          if (how == Meeting::kNone) {
            continue;
          }
          const auto [block_out, block_lse] = block_forward(q.narrow(2, qc.offset, qc.length),
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
        }
      }
    }
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
  const auto mine = chunks_of(r.rank, r.size, local, load_balance && is_causal);
  for (int64_t step = 0; step < r.size; ++step) {
    const int64_t source = (r.rank - step + r.size) % r.size;
    std::optional<Ring::Transfer> next;
    if (step + 1 < r.size) {
      next = r.pass(keys_values, kKeysValuesTag);
    }
    const auto keys = keys_values.narrow(0, 0, batch);
    const auto values = keys_values.narrow(0, batch, batch);
    auto dk = grads.narrow(0, 0, batch);
    auto dv = grads.narrow(0, batch, batch);
    {  // (the profiler's range of the block's compute)
      RECORD_FUNCTION("torch_mp::ring_attention compute", std::vector<c10::IValue>());
      for (const auto& qc : mine) {
        for (const auto& kc : chunks_of(source, r.size, local, load_balance && is_causal)) {
          const Meeting how = meeting(qc, kc, is_causal);
          if (how == Meeting::kNone) {
            continue;
          }
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
        }
      }
    }
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

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_named(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor part_positions_kernel(const at::Tensor& q,
                                 const at::Tensor& k,
                                 const at::Tensor& v,
                                 c10::string_view group_name,
                                 bool is_causal,
                                 bool load_balance) {
  const auto group = group_named(group_name);
  check_parts(q, k, v, group, is_causal, load_balance);
  const int64_t size = group->getSize();
  return sequence_positions(q.size(2) * size, group->getRank(), size, load_balance).to(q.device());
}

at::Tensor part_positions_meta(
    const at::Tensor& q, const at::Tensor&, const at::Tensor&, c10::string_view, bool, bool) {
  return at::empty({q.size(2)}, q.options().dtype(at::kLong));
}

at::Tensor checked_positions(const at::Tensor& q,
                             const at::Tensor& k,
                             const at::Tensor& v,
                             const GroupPtr& group,
                             bool is_causal,
                             bool load_balance) {
  using Signature = at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, bool, bool);
  static const auto op = op_named<Signature>("torch_mp::context_part_positions");
  return op.call(q, k, v, group_name(group), is_causal, load_balance);
}

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

// ---- the operator -----------------------------------------------------------------------------

at::Tensor context_attention(const at::Tensor& q,
                             const at::Tensor& k,
                             const at::Tensor& v,
                             c10::string_view group_name,
                             bool is_causal,
                             std::optional<double> scale,
                             c10::string_view method,
                             bool load_balance,
                             const std::optional<at::Tensor>& attn_mask) {
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  const auto group = group_named(group_name);
  if (method == "ring") {
    TORCH_CHECK(!attn_mask || !attn_mask->defined(),
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
    return op.call(q, k, v, group_name, is_causal, s, load_balance);
  }
  if (method == "all_gather") {
    return all_gather_attention(q, k, v, group, is_causal, s, load_balance, attn_mask);
  }
  TORCH_CHECK(method == "all_to_all",
              kWhat,
              ": method must be 'ring', 'all_gather' or "
              "'all_to_all', got '",
              method,
              "'");
  return all_to_all_attention(q, k, v, group, is_causal, s, load_balance, attn_mask);
}

}  // namespace

at::Tensor attention(const at::Tensor& q,
                     const at::Tensor& k,
                     const at::Tensor& v,
                     const GroupPtr& group,
                     const AttentionOptions& options) {
  using Signature = at::Tensor(const at::Tensor&,
                               const at::Tensor&,
                               const at::Tensor&,
                               c10::string_view,
                               bool,
                               std::optional<double>,
                               c10::string_view,
                               bool,
                               const std::optional<at::Tensor>&);
  static const auto op = op_named<Signature>("torch_mp::context_attention");
  return op.call(q,
                 k,
                 v,
                 group_name(group),
                 options.is_causal(),
                 options.scale(),
                 options.method(),
                 options.load_balance(),
                 options.attn_mask());
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def(
      "context_attention(Tensor q, Tensor k, Tensor v, str group, bool is_causal=False, "
      "float? scale=None, str method=\"ring\", bool load_balance=True, Tensor? attn_mask=None) "
      "-> Tensor");
  m.def(
      "context_part_positions(Tensor q, Tensor k, Tensor v, str group, bool is_causal, "
      "bool load_balance) -> Tensor");
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

TORCH_LIBRARY_IMPL(torch_mp, CompositeImplicitAutograd, m) {
  m.impl("context_attention", &context_attention);
}

TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) { m.impl("ring_attention", &ring_autograd); }

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("context_part_positions", &part_positions_kernel);
  m.impl("ring_attention", &ring_inference);
  m.impl("ring_attention_forward", &ring_forward_kernel);
  m.impl("ring_attention_backward", &ring_backward_kernel);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("context_part_positions", &part_positions_meta);
  m.impl("ring_attention_forward", &ring_forward_meta);
  m.impl("ring_attention_backward", &ring_backward_meta);
}

}  // namespace torch_mp::context_parallel
