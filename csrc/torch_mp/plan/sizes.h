#pragma once
// The sizes the estimate's counts are made of (plan/estimate.cpp), the activations' counts
// (plan/activations.cpp) and those of a mixture of experts' layer (plan/moe.cpp). Internal to
// plan/.

#include <cstdint>
#include <vector>

#include "torch_mp/plan/estimate.h"

namespace torch_mp::plan::detail {

using Shapes = std::vector<std::vector<int64_t>>;

struct Sizes {
  // n: the tokens of a micro-batch one context rank holds; s: the whole sequence; c: cp
  int64_t t, h, f, heads, vocab_shard, positions, n, s, c, d, stages, per_stage;
  double sigma;  // share of the tokens each tensor rank holds between the layers' matmuls
  bool masters;
  const Traced* traced;  // a traced model's measurements, or null for the GPT's formulas
  // A mixture of experts in every layer (experts > 0): top_k of them per token, experts / ep on
  // each rank of the expert group.
  int64_t experts = 0, top_k = 0, ep = 1;
  // The rows the busiest rank's experts receive over the balanced share (Layout::expert_load).
  double expert_load = 1;

  bool moe() const { return experts > 0; }
};

// One tensor rank's parameter shapes: the first stage's before its layers, each layer's, and the
// last stage's after them.
struct Parts {
  Shapes first, layer, last;
};
/// Those of `z`'s model (plan/estimate.cpp).
Parts parts_of(const Sizes& z);

// The activations (plan/activations.cpp), each of one micro-batch.

/// Saved for the backward by one layer without recomputation.
int64_t layer_full(const Sizes& z);
/// Saved by one layer under `recompute`.
int64_t layer_saved(const Sizes& z, Recompute recompute);
/// Saved by stage `i` (its layers and its ends).
int64_t stage_activations(const Sizes& z, const Layout& l, int64_t i);
/// Held after a split backward's B of stage `i` until its W.
int64_t weight_work(const Sizes& z, int64_t i);
/// What a backward action (`weight`: a W) of `stage` holds beyond the saved activations.
int64_t backward_transient(const Sizes& z, const Layout& l, int64_t stage, bool weight);

// A mixture-of-experts layer of the GPT (torch_mp.models.ParallelMoELayer), each count for one
// micro-batch on one rank: each rank sends n * top_k choices, and the busiest rank's experts
// receive expert_load times as many.

/// Layout::expert_load, or its default.
double expert_load(const ModelShape& model, const Layout& layout);
/// Its parameters on one rank, in the layer's order.
Shapes moe_layer_parameters(const Sizes& z);
/// Saved for the backward by its forward.
int64_t moe_layer_saved(const Sizes& z);
/// What its backward holds beyond the saved tensors.
int64_t moe_layer_backward(const Sizes& z);
/// Its forward's floating-point operations (the attention core's among them: attention_flops).
double moe_layer_flops(const Sizes& z);
/// Bytes its forward sends over the expert group (the tokens there and back; as much again in the
/// backward), in messages (two all-to-alls).
double moe_layer_ep_bytes(const Sizes& z);

}  // namespace torch_mp::plan::detail
