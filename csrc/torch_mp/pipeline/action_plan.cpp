// What the executor knows of an action list before running it (action_plan.h): each
// transfer's route, the receives to post ahead, when sends may go, each stage's last backward.

#include "torch_mp/pipeline/action_plan.h"

#include <optional>
#include <set>
#include <tuple>

namespace torch_mp::pipeline {
namespace {

// The message a receive takes: RECV_F(s,m) <- SEND_F(s-1,m), RECV_B(s,m) <- SEND_B(s+1,m).
Action sender_of(const Action& recv) {
  return recv.kind == ActionKind::kRecvForward
             ? Action{ActionKind::kSendForward, recv.stage - 1, recv.microbatch}
             : Action{ActionKind::kSendBackward, recv.stage + 1, recv.microbatch};
}

// The receive a send feeds.
Action receiver_of(const Action& send) {
  return send.kind == ActionKind::kSendForward
             ? Action{ActionKind::kRecvForward, send.stage + 1, send.microbatch}
             : Action{ActionKind::kRecvBackward, send.stage - 1, send.microbatch};
}

// Where each action stands in each rank's list.
class Positions {
 public:
  explicit Positions(const std::vector<std::vector<Action>>& lists) : position_(lists.size()) {
    for (size_t r = 0; r < lists.size(); ++r) {
      for (size_t i = 0; i < lists[r].size(); ++i) {
        const Action& a = lists[r][i];
        position_[r][{a.kind, a.stage, a.microbatch}] = i;
      }
    }
  }

  // The index of `a` in rank `r`'s list, if it is there.
  std::optional<size_t> of(int64_t r, const Action& a) const {
    const auto it = position_[r].find({a.kind, a.stage, a.microbatch});
    return it == position_[r].end() ? std::optional<size_t>() : std::optional<size_t>(it->second);
  }

 private:
  std::vector<std::map<std::tuple<ActionKind, int64_t, int64_t>, size_t>> position_;
};

// The first receive after `send` (at `index` of `mine`) whose message `peer` sent after taking
// the send's (at `taken_at` of its list).
std::optional<size_t> first_receive_after(const std::vector<Action>& mine,
                                          size_t index,
                                          int64_t peer,
                                          size_t taken_at,
                                          const Positions& positions,
                                          const Schedule& schedule) {
  for (size_t j = index + 1; j < mine.size(); ++j) {
    if (!is_recv(mine[j])) {
      continue;
    }
    const Action sent = sender_of(mine[j]);
    if (schedule.rank_of_stage(sent.stage) != peer) {
      continue;
    }
    const auto sent_at = positions.of(peer, sent);
    if (sent_at && *sent_at > taken_at) {
      return j;
    }
  }
  return std::nullopt;
}

std::vector<LastBackward> last_backwards(const std::vector<Action>& actions,
                                         const Schedule& schedule) {
  std::vector<LastBackward> last(schedule.stages_per_rank);
  for (size_t i = 0; i < actions.size(); ++i) {
    auto& stage = last[actions[i].stage / schedule.num_ranks()];
    switch (actions[i].kind) {
      case ActionKind::kFullBackward:
        stage.full = i;
        break;
      case ActionKind::kBackwardInput:
        stage.input = i;
        break;
      case ActionKind::kBackwardWeight:
        stage.weight = i;
        break;
      default:
        break;
    }
  }
  return last;
}

}  // namespace

bool is_recv(const Action& a) {
  return a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward;
}

bool is_send(const Action& a) {
  return a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward;
}

int64_t peer_stage(const Action& a) {
  const bool towards_next =
      a.kind == ActionKind::kSendForward || a.kind == ActionKind::kRecvBackward;
  return a.stage + (towards_next ? 1 : -1);
}

int64_t message_of(const Action& a, const Schedule& schedule) {
  const bool forward = a.kind == ActionKind::kSendForward || a.kind == ActionKind::kRecvForward;
  const int64_t sender = is_recv(a) ? peer_stage(a) : a.stage;
  return ((forward ? 0 : 1) * schedule.num_stages + sender) * schedule.num_microbatches +
         a.microbatch;
}

std::vector<Action> forward_only(const std::vector<Action>& actions) {
  std::vector<Action> out;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
        a.kind == ActionKind::kRecvForward) {
      out.push_back(a);
    }
  }
  return out;
}

std::map<size_t, std::vector<size_t>> sends_released_by(
    const std::vector<std::vector<Action>>& lists, const Schedule& schedule, int64_t rank) {
  const Positions positions(lists);
  std::map<size_t, std::vector<size_t>> released;
  const auto& mine = lists[rank];
  for (size_t i = 0; i < mine.size(); ++i) {
    if (!is_send(mine[i])) {
      continue;
    }
    const Action taken = receiver_of(mine[i]);
    const int64_t peer = schedule.rank_of_stage(taken.stage);
    const auto taken_at = positions.of(peer, taken);
    if (!taken_at) {
      continue;
    }
    if (const auto j = first_receive_after(mine, i, peer, *taken_at, positions, schedule)) {
      released[*j].push_back(i);
    }
  }
  return released;
}

std::map<size_t, std::vector<size_t>> p2p_groups(const std::vector<Action>& list,
                                                 const Schedule& schedule) {
  std::map<size_t, std::vector<size_t>> groups;
  for (size_t i = 0; i < list.size();) {
    if (is_compute(list[i].kind)) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < list.size() && !is_compute(list[end].kind)) {
      ++end;
    }
    auto* group = &groups[i];  // the run's sends, then its receives
    for (size_t j = i; j < end; ++j) {
      if (is_send(list[j])) {
        group->push_back(j);
      }
    }
    std::set<int64_t> receiving_from;
    for (size_t j = i; j < end; ++j) {
      if (!is_recv(list[j])) {
        continue;
      }
      const int64_t peer = schedule.rank_of_stage(peer_stage(list[j]));
      if (!receiving_from.insert(peer).second) {  // a second receive from `peer`: a new group
        group = &groups[j];
        receiving_from = {peer};
      }
      group->push_back(j);
    }
    i = end;
  }
  return groups;
}

size_t LastBackward::of(ActionKind kind) const {
  return kind == ActionKind::kFullBackward    ? full
         : kind == ActionKind::kBackwardInput ? input
                                              : weight;
}

ActionPlan plan_actions(const Schedule& schedule, int64_t rank, bool train) {
  std::vector<std::vector<Action>> lists = schedule.actions;
  if (!train) {
    for (auto& list : lists) {
      list = forward_only(list);
    }
  }
  ActionPlan plan;
  plan.actions = lists[rank];
  plan.sends_released_by = sends_released_by(lists, schedule, rank);
  plan.last_backward = last_backwards(plan.actions, schedule);
  plan.groups = p2p_groups(plan.actions, schedule);
  plan.routes.resize(plan.actions.size());
  for (size_t i = 0; i < plan.actions.size(); ++i) {
    const Action& a = plan.actions[i];
    if (!is_recv(a) && !is_send(a)) {
      continue;
    }
    plan.routes[i] =
        Route{static_cast<int>(schedule.rank_of_stage(peer_stage(a))), message_of(a, schedule)};
    if (is_recv(a)) {
      plan.receives.push_back(i);
    }
  }
  return plan;
}

}  // namespace torch_mp::pipeline
