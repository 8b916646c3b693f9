#include "torch_mp/pipeline/nccl_streams.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace torch_mp::pipeline {
namespace {

bool is_send(ActionKind kind) {
  return kind == ActionKind::kSendForward || kind == ActionKind::kSendBackward;
}

// The message a receive expects: RECV_F(s,m) <- SEND_F(s-1,m); RECV_B(s,m) <- SEND_B(s+1,m).
Action expected_send(const Action& recv) {
  return recv.kind == ActionKind::kRecvForward
             ? Action{ActionKind::kSendForward, recv.stage - 1, recv.microbatch}
             : Action{ActionKind::kSendBackward, recv.stage + 1, recv.microbatch};
}

}  // namespace

int64_t NcclStreams::peer_of(const Op& op) const {
  const Action& a = op.action;
  switch (a.kind) {
    case ActionKind::kSendForward:
      return s_.rank_of_stage(a.stage + 1);
    case ActionKind::kSendBackward:
      return s_.rank_of_stage(a.stage - 1);
    default:
      return s_.rank_of_stage(expected_send(a).stage);
  }
}

void NcclStreams::post(
    int64_t rank, size_t index, const Action& action, double time, int64_t group) {
  const size_t id = ops_.size();
  ops_.push_back({rank, index, action, time, group, std::nullopt});
  const int64_t peer = peer_of(ops_.back());
  streams_[{rank, peer}].push_back(id);
  (is_send(action.kind) ? sends_[{rank, peer}] : recvs_[{peer, rank}]).push_back(id);
  by_action_[{rank, index}] = id;
}

bool NcclStreams::startable(const Op& op) const {
  // Everything this rank posted to the same peer before, outside op's group, has completed.
  const auto& stream = streams_.at({op.rank, peer_of(op)});
  for (size_t id : stream) {  // in posting order
    const Op& earlier = ops_[id];
    if (&earlier == &op) {
      break;
    }
    if (earlier.group != op.group && !earlier.done) {
      return false;
    }
  }
  return true;
}

void NcclStreams::progress() {
  for (bool matched = true; matched;) {
    matched = false;
    for (auto& [direction, sends] : sends_) {
      size_t& next_send = next_send_[direction];
      size_t& next_recv = next_recv_[direction];
      const auto recvs = recvs_.find(direction);
      if (next_send >= sends.size() || recvs == recvs_.end() || next_recv >= recvs->second.size()) {
        continue;
      }
      Op& send = ops_[sends[next_send]];
      Op& recv = ops_[recvs->second[next_recv]];
      if (!(expected_send(recv.action) == send.action)) {
        if (!misrouted_) {
          std::ostringstream message;
          message << "torch_mp.pipeline: under NCCL (tags ignored, messages matched in order) rank "
                  << send.rank << "'s " << send.action.to_string() << " (step " << send.index
                  << ") would land in rank " << recv.rank << "'s " << recv.action.to_string()
                  << " (step " << recv.index << "), which expects "
                  << expected_send(recv.action).to_string();
          const Action& a = send.action;
          const Action meant_for =
              a.kind == ActionKind::kSendForward
                  ? Action{ActionKind::kRecvForward, a.stage + 1, a.microbatch}
                  : Action{ActionKind::kRecvBackward, a.stage - 1, a.microbatch};
          misrouted_ = Misrouted{recv.rank, recv.index, meant_for, message.str()};
        }
        continue;
      }
      if (!startable(send) || !startable(recv)) {
        continue;
      }
      const double done = std::max(send.posted, recv.posted) + latency_;
      send.done = done;
      recv.done = done;
      ++next_send;
      ++next_recv;
      matched = true;
    }
  }
}

std::optional<double> NcclStreams::completed(int64_t rank, size_t index) const {
  const auto it = by_action_.find({rank, index});
  return it == by_action_.end() ? std::nullopt : ops_[it->second].done;
}

bool NcclStreams::idle() const {
  return std::all_of(ops_.begin(), ops_.end(), [](const Op& op) { return op.done.has_value(); });
}

std::optional<std::pair<int64_t, size_t>> NcclStreams::held_send() const {
  for (const auto& [stream, ids] : streams_) {
    for (size_t id : ids) {
      const Op& op = ops_[id];
      if (!op.done) {
        if (is_send(op.action.kind)) {
          return std::make_pair(op.rank, op.index);
        }
        break;
      }
    }
  }
  return std::nullopt;
}

std::string NcclStreams::pending() const {
  std::ostringstream out;
  for (const auto& [stream, ids] : streams_) {
    for (size_t id : ids) {
      const Op& op = ops_[id];
      if (!op.done) {
        out << "\n  NCCL stream rank " << stream.first << " -> rank " << stream.second
            << " is held at step " << op.index << ", " << op.action.to_string();
        break;
      }
    }
  }
  return out.str();
}

}  // namespace torch_mp::pipeline
