// The gathering methods of context-parallel attention (attention_methods.h): all_gather (K/V
// gathered) and all_to_all (Ulysses), with the masks they build for the whole sequence.

#include <ATen/ATen.h>

#include <limits>
#include <optional>

#include "torch_mp/collectives.h"
#include "torch_mp/context_parallel/all_to_all.h"
#include "torch_mp/context_parallel/attention_methods.h"
#include "torch_mp/context_parallel/sharding.h"

namespace torch_mp::context_parallel::detail {
namespace {

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

}  // namespace

at::Tensor all_gather_attention(const at::Tensor& q,
                                const at::Tensor& k,
                                const at::Tensor& v,
                                const GroupPtr& group,
                                const AttentionOptions& options) {
  const bool is_causal = options.is_causal(), load_balance = options.load_balance();
  const int64_t size = group->getSize();
  const int64_t s = q.size(2) * size;
  // The parts' shapes agreed before the gathers (a rank with another length would leave them
  // waiting), by an operator so that compiled code checks them too.
  const auto rows = checked_positions(q, k, v, group, options);
  // Gathered K/V: the gradient of each rank's queries' use of them is summed (reduce-scatter).
  const auto keys = gather_from_sp(k, group, 2);
  const auto values = gather_from_sp(v, group, 2);
  const auto cols = gathered_positions(s, size, load_balance).to(q.device());
  const auto mask = mask_for(rows, cols, is_causal, options.attn_mask(), 0, q.size(1), q.size(1));
  return sdpa(q, keys, values, mask, scale_of(q, options));
}

at::Tensor all_to_all_attention(const at::Tensor& q,
                                const at::Tensor& k,
                                const at::Tensor& v,
                                const GroupPtr& group,
                                const AttentionOptions& options) {
  const bool is_causal = options.is_causal(), load_balance = options.load_balance();
  const double scale = scale_of(q, options);
  const auto& attn_mask = options.attn_mask();
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

}  // namespace torch_mp::context_parallel::detail
