#include "torch_mp/pipeline/zero_bubble.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <numeric>

namespace torch_mp::pipeline {

std::vector<std::vector<Action>> zero_bubble_fill(const std::vector<std::vector<Action>>& order,
                                                  int64_t num_stages,
                                                  int64_t num_microbatches) {
  constexpr int64_t kUnknown = std::numeric_limits<int64_t>::max();
  const auto ranks = static_cast<int64_t>(order.size());
  // Finish times (unit costs) of F(s, m) and B(s, m); kUnknown until they run.
  std::vector<std::vector<int64_t>> forward_done(num_stages,
                                                 std::vector<int64_t>(num_microbatches, kUnknown));
  auto backward_done = forward_done;
  auto ready_at = [&](const Action& a) {
    if (a.kind == ActionKind::kForward) {
      return a.stage == 0 ? 0 : forward_done[a.stage - 1][a.microbatch];
    }
    return a.stage == num_stages - 1 ? forward_done[a.stage][a.microbatch]
                                     : backward_done[a.stage + 1][a.microbatch];
  };

  std::vector<std::vector<Action>> out(ranks);
  std::vector<size_t> next(ranks, 0);
  std::vector<int64_t> clock(ranks, 0);
  std::vector<std::deque<Action>> pending(ranks);  // B's whose W is still to run, oldest first
  auto run_weight = [&](int64_t r) {
    out[r].push_back(pending[r].front());
    pending[r].pop_front();
    clock[r] += 1;
  };

  std::vector<int64_t> by_clock(ranks);
  std::iota(by_clock.begin(), by_clock.end(), 0);
  for (bool progress = true; progress;) {
    progress = false;
    // Ranks that are furthest behind act first, so that "not ready" means "not produced yet".
    std::stable_sort(by_clock.begin(), by_clock.end(), [&](int64_t a, int64_t b) {
      return clock[a] < clock[b];
    });
    for (int64_t r : by_clock) {
      const auto max_pending = static_cast<size_t>(ranks - 1);
      if (next[r] == order[r].size()) {
        while (!pending[r].empty()) {
          run_weight(r);
          progress = true;
        }
        continue;
      }
      const Action& a = order[r][next[r]];
      const int64_t ready = ready_at(a);
      const bool must_drain = pending[r].size() > max_pending;
      if (!pending[r].empty() && (must_drain || ready > clock[r])) {
        run_weight(r);  // fills a wait, or keeps the deferred W's within the rank's budget
      } else if (ready != kUnknown) {
        clock[r] = std::max(clock[r], ready) + 1;
        (a.kind == ActionKind::kForward ? forward_done : backward_done)[a.stage][a.microbatch] =
            clock[r];
        out[r].push_back(a);
        if (a.kind == ActionKind::kBackwardInput) {
          pending[r].push_back({ActionKind::kBackwardWeight, a.stage, a.microbatch});
        }
        ++next[r];
      } else {
        continue;  // waits for a rank that has not produced its input yet
      }
      progress = true;
    }
  }
  for (int64_t r = 0; r < ranks; ++r) {
    TORCH_INTERNAL_ASSERT(next[r] == order[r].size() && pending[r].empty(),
                          "zero_bubble_fill: rank ",
                          r,
                          " could not place all its actions");
  }
  return out;
}

std::vector<std::vector<Action>> zero_bubble_v(int64_t num_ranks, int64_t num_microbatches) {
  const int64_t p = num_ranks;
  const int64_t m = num_microbatches;
  // With fewer than 2p - 1 micro-batches the pattern is built for 2p - 1 and the missing ones
  // are left out (their slots are waits).
  const int64_t n = std::max(m, 2 * p - 1);
  std::vector<std::vector<Action>> out(p);
  for (int64_t r = 0; r < p; ++r) {
    const int64_t stage[2] = {r, 2 * p - 1 - r};  // the rank's two stages, down and up the V
    int64_t forwards[2] = {0, 0};
    int64_t backwards[2] = {0, 0};
    int64_t weights[2] = {0, 0};
    auto emit = [&](ActionKind kind, int chunk) {
      int64_t* counter = kind == ActionKind::kForward         ? forwards
                         : kind == ActionKind::kBackwardInput ? backwards
                                                              : weights;
      const int64_t mb = counter[chunk]++;
      if (mb < m) {
        out[r].push_back({kind, stage[chunk], mb});
      }
    };
    auto forward_backward_weight = [&](int chunk) {
      emit(ActionKind::kForward, chunk);
      emit(ActionKind::kBackwardInput, chunk);
      emit(ActionKind::kBackwardWeight, chunk);
    };
    for (int64_t i = 0; i < 2 * (p - r) - 1; ++i) {  // down the V
      emit(ActionKind::kForward, 0);
    }
    for (int64_t i = 0; i < r; ++i) {  // up the V, while the down side still fills
      emit(ActionKind::kForward, 1);
      emit(ActionKind::kForward, 0);
    }
    for (int64_t i = 0; i < p - r; ++i) {  // the first micro-batches turn at the V's bottom
      forward_backward_weight(1);
    }
    while (forwards[0] < n || forwards[1] < forwards[0]) {  // steady state: F B W per stage
      if (forwards[0] < n) {
        emit(ActionKind::kForward, 0);
      }
      emit(ActionKind::kBackwardInput, 0);
      emit(ActionKind::kBackwardWeight, 0);
      forward_backward_weight(1);
    }
    for (int64_t i = 0; i < r; ++i) {  // cool-down: B's first, W's fill behind them
      emit(ActionKind::kBackwardInput, 0);
      emit(ActionKind::kBackwardInput, 1);
    }
    for (int64_t i = 0; i < p - r; ++i) {
      emit(ActionKind::kBackwardInput, 0);
      emit(ActionKind::kBackwardWeight, 0);
    }
    while (weights[1] < backwards[1]) {
      emit(ActionKind::kBackwardWeight, 1);
    }
    while (weights[0] < backwards[0]) {
      emit(ActionKind::kBackwardWeight, 0);
    }
    TORCH_INTERNAL_ASSERT(forwards[0] == n && backwards[0] == n && weights[0] == n &&
                              forwards[1] == n && backwards[1] == n && weights[1] == n,
                          "zero_bubble_v: rank ",
                          r,
                          " does not run every micro-batch once");
  }
  return out;
}

}  // namespace torch_mp::pipeline
