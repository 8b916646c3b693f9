// Attention over a sequence split across a context group (attention.h): the operator, which
// picks a method (attention_methods.h), and the check of the parts every method runs first.

#include "torch_mp/context_parallel/attention.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "torch_mp/agreement.h"
#include "torch_mp/context_parallel/attention_methods.h"
#include "torch_mp/context_parallel/sharding.h"

namespace torch_mp::context_parallel {
namespace detail {

double scale_of(const at::Tensor& q, const AttentionOptions& options) {
  return options.scale().value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
}

void check_parts(const at::Tensor& q,
                 const at::Tensor& k,
                 const at::Tensor& v,
                 const GroupPtr& group,
                 const AttentionOptions& options) {
  const bool is_causal = options.is_causal(), load_balance = options.load_balance();
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

at::Tensor checked_positions(const at::Tensor& q,
                             const at::Tensor& k,
                             const at::Tensor& v,
                             const GroupPtr& group,
                             const AttentionOptions& options) {
  using Signature = at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, bool, bool);
  static const auto op = op_named<Signature>("torch_mp::context_part_positions");
  return op.call(q, k, v, group_name(group), options.is_causal(), options.load_balance());
}

}  // namespace detail

namespace {

using detail::op_named;

at::Tensor part_positions_kernel(const at::Tensor& q,
                                 const at::Tensor& k,
                                 const at::Tensor& v,
                                 c10::string_view group_name,
                                 bool is_causal,
                                 bool load_balance) {
  const auto group = group_named(group_name);
  detail::check_parts(
      q, k, v, group, AttentionOptions().is_causal(is_causal).load_balance(load_balance));
  const int64_t size = group->getSize();
  return sequence_positions(q.size(2) * size, group->getRank(), size, load_balance).to(q.device());
}

at::Tensor part_positions_meta(
    const at::Tensor& q, const at::Tensor&, const at::Tensor&, c10::string_view, bool, bool) {
  return at::empty({q.size(2)}, q.options().dtype(at::kLong));
}

at::Tensor context_attention(const at::Tensor& q,
                             const at::Tensor& k,
                             const at::Tensor& v,
                             c10::string_view group_name,
                             bool is_causal,
                             std::optional<double> scale,
                             c10::string_view method,
                             bool load_balance,
                             const std::optional<at::Tensor>& attn_mask) {
  const auto group = group_named(group_name);
  const auto options = AttentionOptions()
                           .is_causal(is_causal)
                           .scale(scale)
                           .method(std::string(method))
                           .load_balance(load_balance)
                           .attn_mask(attn_mask);
  if (method == "ring") {
    return detail::ring_attention(q, k, v, group, options);
  }
  if (method == "all_gather") {
    return detail::all_gather_attention(q, k, v, group, options);
  }
  TORCH_CHECK(method == "all_to_all",
              detail::kWhat,
              ": method must be 'ring', 'all_gather' or "
              "'all_to_all', got '",
              method,
              "'");
  return detail::all_to_all_attention(q, k, v, group, options);
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
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeImplicitAutograd, m) {
  m.impl("context_attention", &context_attention);
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("context_part_positions", &part_positions_kernel);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) { m.impl("context_part_positions", &part_positions_meta); }

}  // namespace torch_mp::context_parallel
