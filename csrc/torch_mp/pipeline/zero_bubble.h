#pragma once
// Zero-bubble schedules: the backward split into B (input gradient, on the critical path) and W
// (weight gradient, which nothing downstream waits for), W placed where a rank would wait.
//
// ZB-H1 ("handcrafted 1") is 1F1B with W filling its waits, interleaved zero-bubble the same
// for interleaved 1F1B; ZB-V holds two stages per rank, placed in a V.

#include <vector>

#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {

/// Places the W of every B into per-rank compute lists `order` (F and B in a 1F1B-family
/// order: ZB-H1 from 1F1B, interleaved zero-bubble from interleaved 1F1B). W fills the slots
/// where a rank would otherwise wait: the lists are replayed with unit costs (F = B = W = 1) and
/// a rank whose next F or B is not ready runs its oldest pending W instead. A rank defers at
/// most p W's (a W holds only its stage's input and output gradient); activations are freed by
/// B in the order's sequence, so the peak of live micro-batches stays the order's. With
/// F = B = W the bubble of ZB-H1 is the bound (p - 1) / (3m + p - 1), a third of 1F1B's.
std::vector<std::vector<Action>> zero_bubble_fill(const std::vector<std::vector<Action>>& order,
                                                  int64_t num_stages,
                                                  int64_t num_microbatches);

/// Per-rank compute lists of ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6):
/// two stages per rank placed in a V (rank r holds stages r and 2p - 1 - r). Each rank runs
/// forwards down the V, then F B W of the micro-batches turning at its stage up the V, then
/// alternates F B W on its two stages, and drains. With F = B = W per stage it replays in
/// 6m + p - 1 units (for m >= 2p - 1): the last rank's start-up wait is the whole bubble; each
/// rank holds at most 2p stage activations, 1F1B's peak of p micro-batches of a rank's layers.
std::vector<std::vector<Action>> zero_bubble_v(int64_t num_ranks, int64_t num_microbatches);

}  // namespace torch_mp::pipeline
