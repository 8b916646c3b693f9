#pragma once
// This rank's end of its pipeline's messages: the group they pass over, the stamp of the running
// step, the tags of each message and what each of its channels last carried (p2p.h).
//
// Messages are bound to their Pipeline and step (the stamp, and each (pipeline, step) its own
// range of tags), so that a message left over from a failed step is never taken for a new one.
// Under NCCL's rules (`ordered`) every message has the same tag and the stamp alone tells them
// apart: a message taken by the wrong receive is refused, not read.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "torch_mp/pipeline/action_plan.h"
#include "torch_mp/pipeline/p2p.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::pipeline {

/// Sends and receives of one rank, by route (action_plan.h), over the pipeline group.
struct Mailbox {
  /// The pipeline group.
  GroupPtr group;
  /// Where received tensors go (the stages' device).
  at::Device device = at::kCPU;
  /// The number of messages of a step (2 * num_stages * num_microbatches).
  int64_t messages_per_step = 1;
  /// The running step: its Pipeline's id, the same on every rank of the group and different for
  /// every Pipeline (and reset) the group has run, and its number (`message` unused).
  MessageStamp stamp;
  /// NCCL's rules: one tag for every message, matched in the order sent (Tags::ordered).
  bool ordered = false;
  /// What this rank last sent through each message's channel, by message number.
  std::map<int64_t, Channel> send_channels;
  /// What this rank last received through each message's channel, by message number.
  std::map<int64_t, Channel> recv_channels;

  /// The tags of `message` in the running step.
  Tags tags(int64_t message) const;
  /// The stamp of `message` in the running step.
  MessageStamp stamp_of(int64_t message) const { return {stamp.pipeline, stamp.step, message}; }
  /// Sends `tensors` along `route`; returns the pending works.
  std::vector<c10::intrusive_ptr<c10d::Work>> send(const Route& route,
                                                   const std::vector<at::Tensor>& tensors);
  /// Posts the receive of `route`'s message.
  PendingRecv post(const Route& route);
  /// Waits for `pending`, posted for `route`, and returns its tensors; `what` names the receive
  /// in errors. Raises PeerFailure if the peer sent a failure marker instead.
  std::vector<at::Tensor> finish(const Route& route, PendingRecv& pending, const std::string& what);
  /// Sends `failure` in place of `route`'s message; returns the pending works (keep them alive).
  std::vector<c10::intrusive_ptr<c10d::Work>> send_failure(const Route& route,
                                                           const PeerFailure& failure);
  /// Agrees on a new stamp.pipeline over the group (one all-reduce), whatever each rank built
  /// before. Collective.
  void agree_on_pipeline_id();
  /// Forgets every channel, agrees on a new pipeline id and numbers steps from 0 again (reset).
  /// Collective.
  void start_over();
};

}  // namespace torch_mp::pipeline
