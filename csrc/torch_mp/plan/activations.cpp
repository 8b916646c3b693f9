// The activations the estimate counts (plan/estimate.cpp): what a layer, a stage and a backward
// action hold, by the GPT's formulas or a trace's measurements.

#include <algorithm>

#include "torch_mp/plan/sizes.h"

namespace torch_mp::plan::detail {

// Saved for the backward per micro-batch by one layer, as the layers save it: the residual
// stream's two sums, the LayerNorms' outputs (their all-gathered inputs to the matmuls under
// sequence parallelism) and statistics, q/k/v, the attention's output and log-sum-exp (fp32),
// and the MLP's two [n, f/t] (before and after gelu).
int64_t layer_full(const Sizes& z) {
  if (z.traced != nullptr) {
    return z.traced->layer_activations;
  }
  if (z.moe()) {
    return moe_layer_saved(z);
  }
  const double per_token =
      z.d * (2.0 * z.h + 2.0 * z.h * z.sigma + 4.0 * z.h / z.t + 2.0 * z.f / z.t + 2.0 * z.sigma) +
      4.0 * z.heads / z.t;
  return static_cast<int64_t>(z.n * per_token);
}

int64_t layer_saved(const Sizes& z, Recompute recompute) {
  switch (recompute) {
    case Recompute::kFull:  // its input only
      return z.traced != nullptr ? z.traced->layer_input
                                 : static_cast<int64_t>(z.d * z.n * z.h * z.sigma);
    case Recompute::kSelective:  // the attention core's log-sum-exp is recomputed
      return layer_full(z) - 4 * z.n * z.heads / z.t;
    case Recompute::kNone:
      break;
  }
  return layer_full(z);
}

int64_t stage_activations(const Sizes& z, const Layout& l, int64_t i) {
  int64_t bytes = z.per_stage * layer_saved(z, l.recompute);
  if (z.traced != nullptr) {
    return bytes + (i == 0 ? z.traced->first_activations : 0) +
           (i == z.stages - 1 ? z.traced->last_activations : 0);
  }
  const int64_t residual = static_cast<int64_t>(z.d * z.n * z.h * z.sigma);
  if (i == 0) {  // token ids (with tp: clamped and the out-of-shard mask), positions, the sum
    bytes += z.n * 8 + (z.t > 1 ? z.n * 9 : 0) + z.s / z.c * 8 + residual;
  }
  if (i == z.stages - 1) {  // the final norm (output, stats), the logits, the loss's fp32 copy
    bytes += residual + (l.sequence_parallel ? z.d * z.n * z.h : 0) +
             static_cast<int64_t>(2 * z.d * z.n * z.sigma) + (z.d + 4) * z.n * z.vocab_shard;
  }
  return bytes;
}

// Held after a split backward's B until its W: the gradients of each weight's output (each
// matrix's rows, per token), the head's included.
int64_t weight_work(const Sizes& z, int64_t i) {
  int64_t rows = 0;
  for (const auto& shape : parts_of(z).layer) {
    // (an expert's [local, out, in]: each token's top_k choices' outputs, under balance)
    rows += shape.size() == 2 ? shape[0] : shape.size() == 3 ? z.top_k * shape[1] : 0;
  }
  int64_t bytes = z.per_stage * z.d * z.n * rows;
  if (i == z.stages - 1) {
    bytes += z.d * z.n * z.vocab_shard;
  }
  return bytes;
}

// What a backward action holds beyond the saved activations while it runs: a recomputed
// layer's activations, and the gradients being made (the GPT's largest: the MLP's).
int64_t backward_transient(const Sizes& z, const Layout& l, int64_t stage, bool weight) {
  const int64_t recomputed = l.recompute == Recompute::kFull ? layer_full(z) : 0;
  if (z.traced != nullptr) {
    const int64_t layer = z.traced->layer_backward + recomputed;
    // On the last stage the layers' backward comes after the head's, whose saved tensors
    // (counted among the live activations) are freed by then.
    return stage == z.stages - 1 && !weight
               ? std::max(z.traced->last_backward, layer - z.traced->last_activations)
               : layer;
  }
  if (z.moe()) {
    return weight ? 0 : moe_layer_backward(z);
  }
  // The context ring's backward carries the keys and values and their gradients, two of each in
  // flight (the one in use and the one arriving).
  const int64_t ring = z.c > 1 ? 4 * z.d * z.n * z.h / z.t : 0;
  return weight ? z.d * 3 * z.h / z.t * (z.n + z.h)
                : z.d * (z.n * z.f / z.t + z.h * z.f / z.t + z.n * z.h) + recomputed + ring;
}

}  // namespace torch_mp::plan::detail
