#include "torch_mp/pipeline/simulate.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "torch_mp/pipeline/action_plan.h"
#include "torch_mp/pipeline/nccl_streams.h"

namespace torch_mp::pipeline {

double CostModel::cost(ActionKind kind) const {
  switch (kind) {
    case ActionKind::kForward:
      return forward;
    case ActionKind::kBackwardInput:
      return weight ? backward : backward / 2;
    case ActionKind::kBackwardWeight:
      return weight ? *weight : backward / 2;
    case ActionKind::kFullBackward:
      return backward + weight.value_or(0.0);
    default:
      return 0.0;
  }
}

namespace {

using Key = std::tuple<ActionKind, int64_t, int64_t>;  // kind, stage, micro-batch

Key key_of(const Action& a) { return {a.kind, a.stage, a.microbatch}; }

std::string where(int64_t rank, size_t step, const Action& a) {
  std::ostringstream out;
  out << "rank " << rank << ", step " << step << ", " << a.to_string();
  return out.str();
}

// The send a receive waits for: RECV_F(s,m) <- SEND_F(s-1,m); RECV_B(s,m) <- SEND_B(s+1,m).
Action matching_send(const Action& recv) {
  return recv.kind == ActionKind::kRecvForward
             ? Action{ActionKind::kSendForward, recv.stage - 1, recv.microbatch}
             : Action{ActionKind::kSendBackward, recv.stage + 1, recv.microbatch};
}

class Replay {
 public:
  Replay(const Schedule& schedule, const CostModel& costs, CommSemantics comm)
      : s_(schedule), costs_(costs), comm_(comm), streams_(schedule, costs.comm) {
    const auto ranks = s_.num_ranks();
    next_.assign(ranks, 0);
    posted_.assign(ranks, 0);
    clock_.assign(ranks, 0.0);
    live_.assign(ranks, 0);
    result_.busy.assign(ranks, 0.0);
    result_.peak_live_microbatches.assign(ranks, 0);
  }

  SimulationResult run() {
    replay();
    TORCH_CHECK(!streams_.misrouted(), streams_.misrouted()->message);
    report_deadlock();
    TORCH_CHECK(comm_ == CommSemantics::kGloo || streams_.idle(),
                "torch_mp.pipeline: under NCCL a send is never received:",
                streams_.pending());
    check_complete();
    for (int64_t r = 0; r < s_.num_ranks(); ++r) {
      result_.makespan = std::max(result_.makespan, clock_[r]);
    }
    double busy = 0;
    for (double b : result_.busy) {
      busy += b;
    }
    result_.bubble_fraction =
        result_.makespan > 0 ? 1.0 - busy / (s_.num_ranks() * result_.makespan) : 0.0;
    std::stable_sort(result_.timeline.begin(),
                     result_.timeline.end(),
                     [](const TimedAction& a, const TimedAction& b) { return a.rank < b.rank; });
    return result_;
  }

  // NCCL: replays until done or stuck; then what holds it up, for make_nccl_safe.
  const NcclStreams& replay_streams() {
    replay();
    return streams_;
  }

 private:
  // Runs every rank as far as it can go.
  void replay() {
    check_placement_and_pairs();
    for (bool progress = true; progress;) {
      progress = false;
      for (int64_t r = 0; r < s_.num_ranks(); ++r) {
        while (next_[r] < s_.actions[r].size() && step(r)) {
          ++next_[r];
          progress = true;
        }
      }
    }
  }

  // Static checks: every action on its stage's rank, every receive with a send and vice versa.
  void check_placement_and_pairs() {
    std::map<Key, int64_t> sends;
    std::map<Key, int64_t> recvs;
    for (int64_t r = 0; r < s_.num_ranks(); ++r) {
      for (size_t i = 0; i < s_.actions[r].size(); ++i) {
        const Action& a = s_.actions[r][i];
        TORCH_CHECK(a.stage >= 0 && a.stage < s_.num_stages && a.microbatch >= 0 &&
                        a.microbatch < s_.num_microbatches,
                    "torch_mp.pipeline: ",
                    where(r, i, a),
                    ": stage or micro-batch out of range (",
                    s_.num_stages,
                    " stages, ",
                    s_.num_microbatches,
                    " micro-batches)");
        TORCH_CHECK(s_.rank_of_stage(a.stage) == r,
                    "torch_mp.pipeline: ",
                    where(r, i, a),
                    ": stage ",
                    a.stage,
                    " lives on rank ",
                    s_.rank_of_stage(a.stage));
        if (a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward) {
          sends[key_of(a)] = r;
        } else if (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward) {
          const Action send = matching_send(a);
          TORCH_CHECK(send.stage >= 0 && send.stage < s_.num_stages,
                      "torch_mp.pipeline: ",
                      where(r, i, a),
                      ": no stage sends this (stage ",
                      send.stage,
                      " does not exist)");
          recvs[key_of(send)] = r;
        }
      }
    }
    for (int64_t r = 0; r < s_.num_ranks(); ++r) {
      for (size_t i = 0; i < s_.actions[r].size(); ++i) {
        const Action& a = s_.actions[r][i];
        if (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward) {
          const Action send = matching_send(a);
          TORCH_CHECK(sends.count(key_of(send)),
                      "torch_mp.pipeline: ",
                      where(r, i, a),
                      ": a receive with no matching send (",
                      send.to_string(),
                      " on rank ",
                      s_.rank_of_stage(send.stage),
                      " is missing)");
        } else if (a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward) {
          TORCH_CHECK(recvs.count(key_of(a)),
                      "torch_mp.pipeline: ",
                      where(r, i, a),
                      ": a send that no rank receives");
        }
      }
    }
  }

  bool done(const Action& a) const { return finished_.count(key_of(a)) > 0; }

  // A dependency that must already have run on this rank, earlier in its list.
  void require(int64_t r, const Action& a, const Action& before) {
    TORCH_CHECK(done(before),
                "torch_mp.pipeline: ",
                where(r, next_[r], a),
                " breaks a dependency: it needs ",
                before.to_string(),
                " to run before it on rank ",
                r);
  }

  // What stage `a.stage`'s neighbour provides: a received message or, when the neighbour
  // lives on the same rank, its finished compute.
  void require_input(
      int64_t r, const Action& a, int64_t neighbour, ActionKind recv, ActionKind local) {
    if (neighbour < 0 || neighbour >= s_.num_stages) {
      return;
    }
    if (s_.rank_of_stage(neighbour) == r) {
      if (local == ActionKind::kFullBackward && !done({local, neighbour, a.microbatch})) {
        local = ActionKind::kBackwardInput;  // either backward of the next stage will do
      }
      require(r, a, {local, neighbour, a.microbatch});
    } else {
      require(r, a, {recv, a.stage, a.microbatch});
    }
  }

  // Runs rank r's next action if it can run now; false if it waits for a message.
  bool step(int64_t r) {
    const Action& a = s_.actions[r][next_[r]];
    double start = clock_[r];
    switch (a.kind) {
      case ActionKind::kForward:
        require_input(r, a, a.stage - 1, ActionKind::kRecvForward, ActionKind::kForward);
        break;
      case ActionKind::kBackwardInput:
      case ActionKind::kFullBackward:
        require(r, a, {ActionKind::kForward, a.stage, a.microbatch});
        require_input(r, a, a.stage + 1, ActionKind::kRecvBackward, ActionKind::kFullBackward);
        break;
      case ActionKind::kBackwardWeight:
        require(r, a, {ActionKind::kBackwardInput, a.stage, a.microbatch});
        break;
      case ActionKind::kSendForward:
        require(r, a, {ActionKind::kForward, a.stage, a.microbatch});
        post_sends_and_receives(r);
        break;
      case ActionKind::kSendBackward:
        if (!done({ActionKind::kBackwardInput, a.stage, a.microbatch})) {
          require(r, a, {ActionKind::kFullBackward, a.stage, a.microbatch});
        }
        post_sends_and_receives(r);
        break;
      case ActionKind::kRecvForward:
      case ActionKind::kRecvBackward: {
        if (comm_ != CommSemantics::kGloo) {
          post_sends_and_receives(r);
          const auto done = streams_.completed(r, next_[r]);
          if (!done) {
            return false;  // NCCL: not matched yet
          }
          start = std::max(start, *done);
          break;
        }
        const auto arrival = arrivals_.find(key_of(matching_send(a)));
        if (arrival == arrivals_.end()) {
          return false;  // the sender has not got there yet
        }
        start = std::max(start, arrival->second);
        break;
      }
    }
    TORCH_CHECK(!done(a), "torch_mp.pipeline: ", where(r, next_[r], a), ": runs twice");
    const double end = start + costs_.cost(a.kind);
    finished_[key_of(a)] = end;
    clock_[r] = end;
    if (a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward) {
      arrivals_[key_of(a)] = end + costs_.comm;
    }
    if (is_compute(a.kind)) {
      result_.busy[r] += end - start;
    }
    if (a.kind == ActionKind::kForward) {
      result_.peak_live_microbatches[r] = std::max(result_.peak_live_microbatches[r], ++live_[r]);
    } else if (a.kind == ActionKind::kBackwardInput || a.kind == ActionKind::kFullBackward) {
      --live_[r];
    }
    result_.timeline.push_back({r, a, start, end});
    return true;
  }

  // NCCL: posts the group of sends and receives that rank r's action at next_[r] starts, if it
  // starts one (kNccl: p2p_groups, as the executor posts them; kNcclUngrouped: each on its own),
  // then matches what can be matched.
  void post_sends_and_receives(int64_t r) {
    if (comm_ == CommSemantics::kGloo) {
      return;
    }
    if (groups_by_start_.empty()) {
      groups_by_start_.resize(s_.num_ranks());
      for (int64_t q = 0; q < s_.num_ranks(); ++q) {
        const auto& list = s_.actions[q];
        if (comm_ == CommSemantics::kNccl) {
          groups_by_start_[q] = p2p_groups(list, s_);
        } else {
          for (size_t i = 0; i < list.size(); ++i) {
            if (!is_compute(list[i].kind)) {
              groups_by_start_[q][i] = {i};
            }
          }
        }
      }
    }
    const auto group = groups_by_start_[r].find(next_[r]);
    if (group != groups_by_start_[r].end() && posted_[r] <= next_[r]) {
      const int64_t id = groups_++;
      for (size_t i : group->second) {
        streams_.post(r, i, s_.actions[r][i], clock_[r], id);
      }
      posted_[r] = next_[r] + 1;
    }
    streams_.progress();
  }

  void report_deadlock() const {
    std::ostringstream blocked;
    for (int64_t r = 0; r < s_.num_ranks(); ++r) {
      if (next_[r] < s_.actions[r].size()) {
        const Action& a = s_.actions[r][next_[r]];
        const Action send = matching_send(a);
        blocked << "\n  " << where(r, next_[r], a) << " waits for " << send.to_string()
                << " on rank " << s_.rank_of_stage(send.stage);
      }
    }
    TORCH_CHECK(blocked.str().empty(),
                "torch_mp.pipeline: the schedule deadlocks",
                comm_ == CommSemantics::kGloo ? "" : " under NCCL",
                "; every unfinished rank waits:",
                blocked.str(),
                comm_ == CommSemantics::kGloo ? "" : streams_.pending());
  }

  // Every forward and backward ran; only every forward for a schedule without backward (an
  // evaluation's, forward_schedule).
  void check_complete() const {
    bool evaluation = true;
    for (const auto& list : s_.actions) {
      for (const Action& a : list) {
        evaluation =
            evaluation && (a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
                           a.kind == ActionKind::kRecvForward);
      }
    }
    for (int64_t stage = 0; stage < s_.num_stages; ++stage) {
      for (int64_t m = 0; m < s_.num_microbatches; ++m) {
        const bool forward = done({ActionKind::kForward, stage, m});
        const bool backward = evaluation || done({ActionKind::kFullBackward, stage, m}) ||
                              (done({ActionKind::kBackwardInput, stage, m}) &&
                               done({ActionKind::kBackwardWeight, stage, m}));
        TORCH_CHECK(forward && backward,
                    "torch_mp.pipeline: stage ",
                    stage,
                    " micro-batch ",
                    m,
                    " never runs its ",
                    forward ? "backward (BW, or B and W)" : "forward",
                    " (rank ",
                    s_.rank_of_stage(stage),
                    ")");
      }
    }
  }

  const Schedule& s_;
  const CostModel& costs_;
  CommSemantics comm_;
  NcclStreams streams_;
  std::vector<size_t> posted_;  // NCCL: the groups starting before posted_[r] are posted
  // NCCL: per rank, the groups of sends and receives posted together, by their first action.
  std::vector<std::map<size_t, std::vector<size_t>>> groups_by_start_;
  int64_t groups_ = 0;
  std::vector<size_t> next_;
  std::vector<double> clock_;
  std::vector<int64_t> live_;
  std::map<Key, double> finished_;
  std::map<Key, double> arrivals_;
  SimulationResult result_;
};

}  // namespace

Schedule make_nccl_safe(Schedule schedule) {
  size_t moves = 0;
  for (const auto& list : schedule.actions) {
    moves += list.size() * list.size();  // each action moves at most across its list
  }
  const CostModel costs;
  for (size_t round = 0; round <= moves; ++round) {
    Replay replay(schedule, costs, CommSemantics::kNccl);
    const NcclStreams& streams = replay.replay_streams();
    if (const auto& misrouted = streams.misrouted()) {
      // Messages between two ranks arrive in the order they are sent: the receive the message
      // is meant for is posted just before the one it would land in. Posting a receive earlier
      // is always valid (what it receives is kept until its computation runs).
      auto& list = schedule.actions[misrouted->rank];
      const auto meant = std::find(list.begin() + static_cast<std::ptrdiff_t>(misrouted->index),
                                   list.end(),
                                   misrouted->meant_for);
      TORCH_CHECK(meant != list.end(), misrouted->message);
      std::rotate(list.begin() + static_cast<std::ptrdiff_t>(misrouted->index), meant, meant + 1);
      continue;
    }
    const auto held = streams.held_send();
    if (!held) {
      return schedule;  // runs (or fails for a reason no move can mend)
    }
    auto& list = schedule.actions[held->first];
    size_t next_compute = held->second + 1;
    while (next_compute < list.size() && !is_compute(list[next_compute].kind)) {
      ++next_compute;
    }
    TORCH_CHECK(next_compute < list.size(),
                "torch_mp.pipeline: under NCCL rank ",
                held->first,
                "'s ",
                list[held->second].to_string(),
                " deadlocks and cannot be moved later");
    const Action send = list[held->second];
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(held->second));
    list.insert(list.begin() + static_cast<std::ptrdiff_t>(next_compute), send);
  }
  TORCH_CHECK(false, "torch_mp.pipeline: the schedule cannot be made to run under NCCL");
}

SimulationResult simulate(const Schedule& schedule, const CostModel& costs, CommSemantics comm) {
  TORCH_CHECK(schedule.num_ranks() > 0, "torch_mp.pipeline.simulate: the schedule has no ranks");
  return Replay(schedule, costs, comm).run();
}

}  // namespace torch_mp::pipeline
