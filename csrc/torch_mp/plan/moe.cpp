// The counts of the GPT's mixture-of-experts layer (plan/sizes.h): torch_mp.models.
// ParallelMoELayer, its attention split over the tensor group and its experts over the expert
// group (moe/moe.h), every tensor rank routing the whole micro-batch.

#include <cmath>

#include "torch_mp/plan/sizes.h"

namespace torch_mp::plan::detail {
namespace {

// The choices a rank routes (n * top_k, what it sends), and what its experts receive: as many
// under balanced routing, times the busiest rank's load (Sizes::expert_load).
double sent(const Sizes& z) { return static_cast<double>(z.n * z.top_k); }
double received(const Sizes& z) { return sent(z) * z.expert_load; }

}  // namespace

double expert_load(const ModelShape& model, const Layout& l) {
  if (l.ep == 1 || l.expert_load > 0) {  // (at ep 1 every expert is here: no imbalance)
    return l.ep == 1 ? 1.0 : l.expert_load;
  }
  const double ep = static_cast<double>(l.ep);
  const double choices = static_cast<double>(l.micro_batch * l.seq_len / l.cp * model.top_k);
  return 1.0 + std::sqrt(2.0 * std::log(ep)) * std::sqrt((ep - 1.0) / (ep * choices));
}

Shapes moe_layer_parameters(const Sizes& z) {
  const int64_t h = z.h, local = z.experts / z.ep;
  // in_proj, out_proj, norm1 and norm2 (no biases), the router, the experts' fc1 and fc2
  return {
      {3 * h / z.t, h}, {h, h / z.t}, {h}, {h}, {z.experts, h}, {local, z.f, h}, {local, h, z.f}};
}

int64_t moe_layer_saved(const Sizes& z) {
  const double n = static_cast<double>(z.n), h = static_cast<double>(z.h);
  const double k = static_cast<double>(z.top_k), d = static_cast<double>(z.d);
  // The attention half: the residual stream's input and sum, the norms' outputs, q/k/v and the
  // attention's output, the norms' statistics, the log-sum-exp (fp32).
  const double attention = n * (d * (4 * h + 4 * h / z.t + 4) + 4.0 * z.heads / z.t);
  // The router: the probabilities (fp32), the top k's indices and values, their sum.
  const double router = n * (4.0 * z.experts + 12 * k + 4);
  // Per choice sent: its token and place (int64) and weight (fp32), its result and weighted
  // result. Per row received: the row (sorted by expert; the sent row itself at ep 1), fc1's
  // output and its activation, and at ep > 1 the arrived rows' order and its inverse (int64).
  const double choices = n * k * (20 + 2 * d * h);
  const double rows = received(z) * (d * (h + 2.0 * z.f) + (z.ep > 1 ? 16 : 0));
  return static_cast<int64_t>(attention + router + choices + rows);
}

int64_t moe_layer_backward(const Sizes& z) {
  const double h = static_cast<double>(z.h), f = static_cast<double>(z.f);
  const double local = static_cast<double>(z.experts / z.ep);
  // The gradients of the experts' rows (fc1's output, their inputs) and of one expert
  // projection's weights, and of the tokens.
  return static_cast<int64_t>(z.d * (received(z) * (f + h) + local * h * f + z.n * h));
}

double moe_layer_flops(const Sizes& z) {
  const double n = static_cast<double>(z.n), h = static_cast<double>(z.h);
  const double attention = 2.0 * n * 4.0 * h * h / z.t + 2.0 * n * z.s * h / z.t;
  // the router, and each choice through its expert's fc1 and fc2
  return attention + 2.0 * n * h * z.experts + received(z) * 4.0 * h * z.f;
}

double moe_layer_ep_bytes(const Sizes& z) {
  if (z.ep == 1) {
    return 0;
  }
  const double share = static_cast<double>(z.ep - 1) / static_cast<double>(z.ep);
  return 2.0 * share * sent(z) * z.h * z.d;
}

}  // namespace torch_mp::plan::detail
