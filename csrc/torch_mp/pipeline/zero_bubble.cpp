#include "torch_mp/pipeline/zero_bubble.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <numeric>

namespace torch_mp::pipeline {

std::vector<std::vector<Action>> zero_bubble_h1(const std::vector<std::vector<Action>>& one_f_one_b,
                                                int64_t num_microbatches) {
  constexpr int64_t kUnknown = std::numeric_limits<int64_t>::max();
  const auto ranks = static_cast<int64_t>(one_f_one_b.size());
  // Finish times (unit costs) of F(s, m) and B(s, m); kUnknown until they run.
  std::vector<std::vector<int64_t>> forward_done(ranks,
                                                 std::vector<int64_t>(num_microbatches, kUnknown));
  auto backward_done = forward_done;
  auto ready_at = [&](const Action& a) {
    if (a.kind == ActionKind::kForward) {
      return a.stage == 0 ? 0 : forward_done[a.stage - 1][a.microbatch];
    }
    return a.stage == ranks - 1 ? forward_done[a.stage][a.microbatch]
                                : backward_done[a.stage + 1][a.microbatch];
  };

  std::vector<std::vector<Action>> out(ranks);
  std::vector<size_t> next(ranks, 0);
  std::vector<int64_t> clock(ranks, 0);
  std::vector<std::deque<int64_t>> pending(ranks);  // micro-batches whose W is still to run
  auto run_weight = [&](int64_t r) {
    out[r].push_back({ActionKind::kBackwardWeight, r, pending[r].front()});
    pending[r].pop_front();
    clock[r] += 1;
  };

  std::vector<int64_t> order(ranks);
  std::iota(order.begin(), order.end(), 0);
  for (bool progress = true; progress;) {
    progress = false;
    // Ranks that are furthest behind act first, so that "not ready" means "not produced yet".
    std::stable_sort(
        order.begin(), order.end(), [&](int64_t a, int64_t b) { return clock[a] < clock[b]; });
    for (int64_t r : order) {
      const auto max_pending = static_cast<size_t>(ranks - 1);
      if (next[r] == one_f_one_b[r].size()) {
        while (!pending[r].empty()) {
          run_weight(r);
          progress = true;
        }
        continue;
      }
      const Action& a = one_f_one_b[r][next[r]];
      const int64_t ready = ready_at(a);
      const bool must_drain = pending[r].size() > max_pending;
      if (!pending[r].empty() && (must_drain || ready > clock[r])) {
        run_weight(r);  // fills a wait, or keeps the deferred W's within the rank's budget
      } else if (ready != kUnknown) {
        clock[r] = std::max(clock[r], ready) + 1;
        (a.kind == ActionKind::kForward ? forward_done : backward_done)[r][a.microbatch] = clock[r];
        out[r].push_back(a);
        if (a.kind == ActionKind::kBackwardInput) {
          pending[r].push_back(a.microbatch);
        }
        ++next[r];
      } else {
        continue;  // waits for a rank that has not produced its input yet
      }
      progress = true;
    }
  }
  for (int64_t r = 0; r < ranks; ++r) {
    TORCH_INTERNAL_ASSERT(next[r] == one_f_one_b[r].size() && pending[r].empty(),
                          "zb_h1: rank ",
                          r,
                          " could not place all its actions");
  }
  return out;
}

}  // namespace torch_mp::pipeline
