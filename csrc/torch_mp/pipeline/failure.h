#pragma once
// The failure protocol: how a failure on one rank reaches every rank, fast and by name.
//
//   1. The failing rank names what failed (failure_of): its rank, stage, micro-batch and action,
//      and the peer, for a timeout or a lost connection (which leave the group broken).
//   2. It sends a failure marker in place of every message it still owed
//      (send_failure_markers), so that its peers, waiting for those messages, raise at once
//      with its error and pass it on in turn (p2p.h: PeerFailure).
//   3. Unless the group is broken, the ranks agree on the step (agree_on_step): one all-reduce
//      of where failures began, then the first one's text, broadcast from its rank. A rank
//      whose own step went well runs the same agreement, and raises with that text.
//   4. Each rank raises (raise_failure), and keeps whatever was in flight alive (Orphans) until
//      the Executor is destroyed: Gloo may still touch the buffers.
//
// failure.cpp also holds the Executor's side of the protocol (Executor::fail, which runs the
// steps above, abandon_in_flight, and reset, which makes the Executor usable again).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/agreement.h"  // text_of
#include "torch_mp/pipeline/action_plan.h"
#include "torch_mp/pipeline/mailbox.h"
#include "torch_mp/pipeline/p2p.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::pipeline {

/// The failure that `e`, raised at `index` of `plan.actions` on `rank`, means: named by rank,
/// stage, micro-batch and action (and by the peer, for communication errors). An index past the
/// last action stands for the step's closing checks.
PeerFailure failure_of(const std::exception& e, const ActionPlan& plan, size_t index, int64_t rank);

/// The failure markers a failed step sent.
struct FailureMarkers {
  /// Every marker's pending works (keep them alive).
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  /// The works of the first marker sent to each peer rank.
  std::map<int64_t, std::vector<c10::intrusive_ptr<c10d::Work>>> first_by_peer;
};

/// Sends `failure` in place of every message that `plan.actions` sends from `index` on, so that
/// the peers waiting for them raise at once. A peer whose connection is gone is not told. Under
/// NCCL's rules (mailbox.ordered) only in place of the first message to each peer: the one its
/// next receive from this rank takes (later ones would wait in the pair's queue, unmatched).
FailureMarkers send_failure_markers(const PeerFailure& failure,
                                    const ActionPlan& plan,
                                    size_t index,
                                    Mailbox& mailbox);

/// For a failure that broke the group (no agreement follows, and the process may exit as soon
/// as the error is raised): gives each peer's first marker (the message it waits for, usually)
/// up to two seconds in all to leave, so that the peer learns what failed rather than that this
/// rank is gone. Not to the peer of the send or receive at `index` of `plan.actions`, which this
/// rank lost or learnt the failure from.
void let_first_markers_leave(FailureMarkers& markers, const ActionPlan& plan, size_t index);

/// Raises, on every rank of `group`, if a rank's step failed: one all-reduce of where failures
/// began, then (only after a failure) the first one's text, broadcast from its rank (over a
/// buffer on `device`). `failure` is this rank's, if its step failed; `rank` is this rank.
/// Collective.
void agree_on_step(const std::optional<PeerFailure>& failure,
                   const GroupPtr& group,
                   int64_t rank,
                   at::Device device);

/// Raises `failure` as `rank` reports it: its own text where the failure began on `rank`;
/// otherwise where `rank` stopped (at `index` of `plan.actions`) and which rank it began on.
[[noreturn]] void raise_failure(const PeerFailure& failure,
                                const ActionPlan& plan,
                                size_t index,
                                int64_t rank);

/// What failed steps left in flight, kept alive so that no buffer is freed under Gloo's threads.
struct Orphans {
  /// Failure markers, and the sends and receives of failed steps.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  /// Groups replaced by reset(), with the works that were pending on them.
  std::vector<GroupPtr> groups;
  /// The buffers of the NCCL groups failed steps posted.
  std::vector<at::Tensor> buffers;
};

}  // namespace torch_mp::pipeline
