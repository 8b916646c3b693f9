#pragma once
// The router of a mixture of experts: which experts each token goes to, with what weight, and
// the load-balancing loss (torch_mp.dense.MoE's definitions, moe.h).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace torch_mp::moe {

/// Where a call's tokens go.
struct Routing {
  /// [T, k] int64: each token's experts, best first.
  at::Tensor experts;
  /// [T, k]: their weights, summing to 1 over the k.
  at::Tensor weights;
  /// [T, E]: every expert's probability (for the load-balancing loss).
  at::Tensor probabilities;
  /// [T, k] bool: the choices an expert's capacity kept (all, dropless).
  at::Tensor kept;
};

/// Routes `tokens` [T, h] by `router_weight` [E, h] (a linear router without bias): "softmax"
/// (softmax over the experts, the top k, renormalised) or "sigmoid" (sigmoids, the top k,
/// renormalised; the probabilities are the sigmoids normalised to sum to 1). With
/// `capacity_factor` each expert keeps the first ceil(capacity_factor * T * k / E) choices of
/// it, in token order.
Routing route(const at::Tensor& tokens,
              const at::Tensor& router_weight,
              int64_t top_k,
              const std::string& router,
              std::optional<double> capacity_factor);

/// The Switch / GShard load-balancing loss coef * E * sum_i f_i * P_i: f_i the share of the
/// T * k choices that picked expert i (before any capacity), P_i expert i's mean probability.
at::Tensor load_balancing_loss(const Routing& routing, double coef);

/// Raises unless `router` is "softmax" or "sigmoid", 1 <= top_k <= num_experts, and
/// capacity_factor (when given) is positive (a capacity of zero would drop every token).
void check_routing(int64_t num_experts,
                   int64_t top_k,
                   const std::string& router,
                   std::optional<double> capacity_factor);

}  // namespace torch_mp::moe
