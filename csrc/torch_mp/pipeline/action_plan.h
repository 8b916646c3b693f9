#pragma once
// What the executor knows of one rank's action list before running it: where each send and
// receive goes, which receives are to be posted ahead, when a send's buffers may go, and which
// backward of each stage is its last (where its data-parallel gradient reduction is armed).
//
// Pure functions of the schedule: the same on every rank, computed once per Executor.

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {

/// True for RECV_F and RECV_B.
bool is_recv(const Action& a);

/// True for SEND_F and SEND_B.
bool is_send(const Action& a);

/// The stage at the other end of a send or receive: SEND_F(s) -> s + 1, RECV_F(s) <- s - 1,
/// SEND_B(s) -> s - 1, RECV_B(s) <- s + 1.
int64_t peer_stage(const Action& a);

/// The number of the message a send or receive passes, the same on both of its ends: named by
/// its sender (SEND_F(s) <-> RECV_F(s + 1), SEND_B(s) <-> RECV_B(s - 1)), in
/// [0, 2 * num_stages * num_microbatches).
int64_t message_of(const Action& a, const Schedule& schedule);

/// The forward half of an action list (F, SEND_F and RECV_F, in order): what evaluation runs.
std::vector<Action> forward_only(const std::vector<Action>& actions);

/// When `rank`'s sends are known to be complete: a send is, once a message arrives that its
/// peer sent after taking it. Gloo's send works do not say they completed until waited on, so
/// this is when their buffers can go (not at the end of the step). By index in lists[rank]:
/// the receive, then the sends it releases.
std::map<size_t, std::vector<size_t>> sends_released_by(
    const std::vector<std::vector<Action>>& lists, const Schedule& schedule, int64_t rank);

/// Under NCCL's rules, the groups in which a rank posts its sends and receives together
/// (comm::P2PGroup), each as the indices in `list` of its members, in posting order. Each run
/// of consecutive sends and receives is one group, posted when the run is reached, sends first,
/// except that a receive from a rank that the group already receives from starts a new group,
/// posted once the receives before it are finished: whatever follows a message (a new layout,
/// a failure) is then the next thing this rank receives from its sender. By the group's first
/// action (the one whose turn posts it).
std::map<size_t, std::vector<size_t>> p2p_groups(const std::vector<Action>& list,
                                                 const Schedule& schedule);

/// The index, in a rank's action list, of one local stage's last BW, B and W (SIZE_MAX where it
/// has none).
struct LastBackward {
  /// The last BW.
  size_t full = SIZE_MAX;
  /// The last B.
  size_t input = SIZE_MAX;
  /// The last W.
  size_t weight = SIZE_MAX;

  /// The last index of `kind`: BW -> full, B -> input, anything else -> weight.
  size_t of(ActionKind kind) const;
};

/// Where a send or receive's message goes: the peer's rank and the message's number
/// (message_of).
struct Route {
  /// The peer's rank in the pipeline group.
  int peer = -1;
  /// message_of the send or receive.
  int64_t message = -1;
};

/// One of this rank's action lists, with what the executor needs to know of it ahead.
struct ActionPlan {
  /// The actions, in order.
  std::vector<Action> actions;
  /// Per action: its route (a default Route for computations).
  std::vector<Route> routes;
  /// The indices of the receives, in order (posted ahead a few at a time).
  std::vector<size_t> receives;
  /// Under NCCL's rules: each group of sends and receives (p2p_groups), by the index of the
  /// action that posts it (its first in `actions`).
  std::map<size_t, std::vector<size_t>> groups;
  /// sends_released_by for this list.
  std::map<size_t, std::vector<size_t>> sends_released_by;
  /// Per local stage (stage / num_ranks): its last backwards.
  std::vector<LastBackward> last_backward;
};

/// The plan of `rank`'s training step (every action; `train`) or evaluation step (forward_only).
ActionPlan plan_actions(const Schedule& schedule, int64_t rank, bool train);

}  // namespace torch_mp::pipeline
