#pragma once
// ZB-H1 (zero-bubble, "handcrafted 1"): 1F1B with the backward split into B (input gradient,
// on the critical path) and W (weight gradient, which nothing downstream waits for).

#include <vector>

#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {

/// Places the W of every B into the per-rank compute lists `one_f_one_b` (1F1B order of F and B,
/// one stage per rank). W fills the slots where a rank would otherwise wait: the lists are
/// replayed with unit costs (F = B = W = 1) and a rank whose next F or B is not ready runs its
/// oldest pending W instead. A rank defers at most p W's (a W holds only its stage's input
/// and output gradient); activations are freed by B in 1F1B order, so the peak of live
/// micro-batches stays 1F1B's. With F = B = W the bubble is the ZB-H1 bound
/// (p - 1) / (3m + p - 1), a third of 1F1B's.
std::vector<std::vector<Action>> zero_bubble_h1(const std::vector<std::vector<Action>>& one_f_one_b,
                                                int64_t num_microbatches);

}  // namespace torch_mp::pipeline
