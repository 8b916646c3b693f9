// The router of a mixture of experts (router.h).

#include "torch_mp/moe/router.h"

#include <ATen/ATen.h>

#include <cmath>

namespace torch_mp::moe {

void check_routing(int64_t num_experts,
                   int64_t top_k,
                   const std::string& router,
                   std::optional<double> capacity_factor) {
  TORCH_CHECK(router == "softmax" || router == "sigmoid",
              "MoE: router must be 'softmax' or 'sigmoid', got '",
              router,
              "'");
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts,
              "MoE: top_k must be in [1, num_experts = ",
              num_experts,
              "], got ",
              top_k);
  TORCH_CHECK(!capacity_factor || (*capacity_factor > 0 && std::isfinite(*capacity_factor)),
              "MoE: capacity_factor must be positive (a capacity of zero drops every token) and "
              "finite (None: dropless), got ",
              capacity_factor.value_or(0.0));
}

Routing route(const at::Tensor& tokens,
              const at::Tensor& router_weight,
              int64_t top_k,
              const std::string& router,
              std::optional<double> capacity_factor) {
  const int64_t num_experts = router_weight.size(0);
  check_routing(num_experts, top_k, router, capacity_factor);
  // Scores, probabilities and weights in at least fp32 (Mixtral's router's, Megatron's
  // moe_router_dtype fp32): near-ties in bf16 would pick other experts than one process does.
  auto logits = at::matmul(tokens, router_weight.t());
  logits = logits.to(at::promote_types(logits.scalar_type(), at::kFloat));
  Routing r;
  at::Tensor scores;
  if (router == "softmax") {
    r.probabilities = at::softmax(logits, -1);
    scores = r.probabilities;
  } else {
    scores = at::sigmoid(logits);
    r.probabilities = scores / scores.sum(-1, true);
  }
  auto [top, chosen] = scores.topk(top_k, -1);
  r.experts = chosen;
  r.weights = top / top.sum(-1, true);
  const int64_t count = tokens.size(0);
  if (!capacity_factor) {
    r.kept = at::ones_like(chosen, chosen.options().dtype(at::kBool));
    return r;
  }
  const auto capacity = static_cast<int64_t>(std::ceil(
      *capacity_factor * static_cast<double>(count * top_k) / static_cast<double>(num_experts)));
  // Each choice's place among its expert's choices, in token order (the row-major order of
  // [T, k]: a token chooses an expert at most once).
  const auto one_hot = at::one_hot(chosen.flatten(), num_experts);
  const auto place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1;
  r.kept = place.lt(capacity).view_as(chosen);
  return r;
}

at::Tensor load_balancing_loss(const Routing& r, double coef) {
  const int64_t num_experts = r.probabilities.size(-1);
  const int64_t choices = r.experts.numel();
  const auto share =
      at::bincount(r.experts.flatten(), {}, num_experts).to(r.probabilities.scalar_type()) /
      static_cast<double>(choices);
  return coef * static_cast<double>(num_experts) * (share * r.probabilities.mean(0)).sum();
}

}  // namespace torch_mp::moe
