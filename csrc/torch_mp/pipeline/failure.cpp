// The failure protocol (failure.h), and the Executor's side of it: fail, abandon_in_flight and
// reset.

#include "torch_mp/pipeline/failure.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>  // Node: dropping a Slot drops its WeightWork

#include <algorithm>
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <sstream>

#include "torch_mp/comm.h"
#include "torch_mp/pipeline/executor.h"

namespace torch_mp::pipeline {
namespace {

// The longest failure text that agree_on_step passes on, with its terminating zero.
constexpr int64_t kTextBytes = 4096;

bool mentions_any(const std::string& text, std::initializer_list<const char*> words) {
  for (const char* word : words) {
    if (text.find(word) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// Gloo's words for a peer that never answered.
bool timed_out(const std::string& text) { return mentions_any(text, {"Timed out", "timed out"}); }

// Gloo's words for a peer whose connection went away (its process died, most often).
bool lost_peer(const std::string& text) {
  return mentions_any(text,
                      {"Connection closed",
                       "closed by peer",
                       "Connection reset",
                       "Broken pipe",
                       "Connection refused",
                       "connection closed"});
}

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

// A send or receive of `rank` that timed out or lost its connection to rank `peer`.
std::string communication_failure(const std::string& text,
                                  const Action& a,
                                  int64_t peer,
                                  int64_t rank) {
  std::ostringstream out;
  out << "Pipeline: rank " << rank << "'s " << a.to_string() << (is_recv(a) ? " from" : " to")
      << " rank " << peer << " (stage " << peer_stage(a) << ") ";
  if (timed_out(text)) {
    out << "got no answer within the group's timeout: rank " << peer
        << " stalled, is slow, or failed without telling its peers";
  } else {
    out << "lost its connection to rank " << peer << " (did its process die?)";
  }
  out << ": " << text;
  return out.str();
}

// The first rank whose step failed, or kNone: one all-reduce.
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

int64_t first_failed_rank(const std::optional<PeerFailure>& failure,
                          const GroupPtr& group,
                          int64_t rank,
                          at::Device device) {
  try {
    return comm::all_reduce(at::scalar_tensor(failure ? failure->origin : kNone,
                                              at::TensorOptions(at::kLong).device(device)),
                            group,
                            c10d::ReduceOp::MIN)
        .item<int64_t>();
  } catch (const std::exception& e) {
    if (failure) {
      throw;
    }
    TORCH_CHECK(false,
                "Pipeline: rank ",
                rank,
                " finished its step, but could not agree on it with its peers (one failed and "
                "left the group broken, stalled, or died): ",
                text_of(e));
  }
}

// The text of the failure that began on rank `first`, broadcast from there: a zero-terminated
// buffer (on `device`).
at::Tensor broadcast_text(int64_t first,
                          const std::optional<PeerFailure>& failure,
                          const GroupPtr& group,
                          int64_t rank,
                          at::Device device) {
  auto text = at::zeros({kTextBytes}, at::kByte);
  if (failure && failure->origin == first && rank == first) {
    const std::string message = failure->what();
    std::memcpy(
        text.data_ptr<uint8_t>(), message.data(), std::min<size_t>(message.size(), kTextBytes - 1));
  }
  std::vector<at::Tensor> buffer{text.to(device)};
  c10d::BroadcastOptions options;
  options.rootRank = first;
  group->broadcast(buffer, options)->wait();
  return buffer[0];
}

std::string string_in(const at::Tensor& text) {
  const auto received = text.cpu();
  const auto* chars = reinterpret_cast<const char*>(received.data_ptr<uint8_t>());
  return std::string(chars, strnlen(chars, kTextBytes));
}

}  // namespace

PeerFailure failure_of(const std::exception& e,
                       const ActionPlan& plan,
                       size_t index,
                       int64_t rank) {
  const std::string text = text_of(e);
  const bool broken = timed_out(text) || lost_peer(text);
  if (index >= plan.actions.size()) {  // after the last action (the step's closing checks)
    return PeerFailure(starts_with(text, "Pipeline: ") ? text : "Pipeline: " + text, rank, broken);
  }
  const Action& a = plan.actions[index];
  if ((is_recv(a) || is_send(a)) && broken) {
    return PeerFailure(communication_failure(text, a, plan.routes[index].peer, rank), rank, broken);
  }
  if (starts_with(text, "Pipeline: ") || starts_with(text, "torch_mp.pipeline: ")) {
    return PeerFailure(text, rank, broken);  // already names the rank, stage and micro-batch
  }
  std::ostringstream out;
  out << "Pipeline: rank " << rank << ", stage " << a.stage << ", micro-batch " << a.microbatch
      << ": " << a.to_string() << " failed: " << text;
  return PeerFailure(out.str(), rank, broken);
}

FailureMarkers send_failure_markers(const PeerFailure& failure,
                                    const ActionPlan& plan,
                                    size_t index,
                                    Mailbox& mailbox) {
  FailureMarkers markers;
  for (size_t j = index; j < plan.actions.size(); ++j) {
    if (!is_send(plan.actions[j])) {
      continue;
    }
    const Route& route = plan.routes[j];
    if (mailbox.ordered && markers.first_by_peer.count(route.peer)) {
      continue;
    }
    try {
      auto works = mailbox.send_failure(route, failure);
      markers.first_by_peer.emplace(route.peer, works);
      markers.works.insert(markers.works.end(), works.begin(), works.end());
    } catch (const std::exception&) {
      // A peer whose connection is gone cannot be told.
    }
  }
  return markers;
}

void let_first_markers_leave(FailureMarkers& markers, const ActionPlan& plan, size_t index) {
  if (index < plan.actions.size() &&
      (is_recv(plan.actions[index]) || is_send(plan.actions[index]))) {
    markers.first_by_peer.erase(plan.routes[index].peer);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (const auto& [peer, works] : markers.first_by_peer) {
    try {
      for (const auto& work : works) {  // the marker, then what failed
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        work->wait(std::max(left, std::chrono::milliseconds(1)));
      }
    } catch (const std::exception&) {
      // Not taken in time (the peer waits for something else): it learns at its timeout.
    }
  }
}

void agree_on_step(const std::optional<PeerFailure>& failure,
                   const GroupPtr& group,
                   int64_t rank,
                   at::Device device) {
  const int64_t first = first_failed_rank(failure, group, rank, device);
  if (first == kNone) {
    return;
  }
  const auto text = broadcast_text(first, failure, group, rank, device);
  if (failure) {
    return;  // this rank raises its own failure
  }
  TORCH_CHECK(false,
              "Pipeline: rank ",
              rank,
              " finished its step, but the step failed on rank ",
              first,
              ": ",
              string_in(text));
}

void raise_failure(const PeerFailure& failure, const ActionPlan& plan, size_t index, int64_t rank) {
  if (failure.origin == rank) {
    TORCH_CHECK(false, failure.what());
  }
  const Action& a = plan.actions[std::min(index, plan.actions.size() - 1)];
  TORCH_CHECK(false,
              "Pipeline: rank ",
              rank,
              " stopped at ",
              a.to_string(),
              " because the step failed on rank ",
              failure.origin,
              ": ",
              failure.what());
}

// The Executor's side of the protocol.

void Executor::fail(const ActionPlan& plan, size_t index, const PeerFailure& failure) {
  // Every message still owed becomes a failure marker: the peers waiting for them raise now.
  // (Under NCCL's rules the sends of the group posted last have left already.)
  auto markers = send_failure_markers(failure, plan, std::max(index, step_.posted_until), mailbox_);
  orphans_.works.insert(orphans_.works.end(), markers.works.begin(), markers.works.end());
  if (failure.group_broken) {
    let_first_markers_leave(markers, plan, index);
  }
  abandon_in_flight();
  if (!failure.group_broken) {
    try {
      agree_on_step(failure, mailbox_.group, rank_, mailbox_.device);
    } catch (const std::exception&) {
      // The agreement failing (a peer died meanwhile) must not hide what failed here.
    }
  }
  raise_failure(failure, plan, index, rank_);
}

void Executor::abandon_in_flight() {
  for (auto& buffer : step_.posted_buffers) {
    orphans_.buffers.push_back(std::move(buffer));
  }
  step_.posted_buffers.clear();
  for (auto& [work, send_index] : step_.pending_sends) {
    orphans_.works.push_back(work);
  }
  step_.pending_sends.clear();
  for (auto& [i, pending] : step_.posted_recvs) {
    orphans_.works.push_back(pending.work);
  }
  step_.posted_recvs.clear();
  step_.slots.clear();
}

void Executor::reset(GroupPtr group) {
  TORCH_CHECK(!(broken_ && mailbox_.ordered && (!group || group == mailbox_.group)),
              "Pipeline.reset: rank ",
              rank_,
              " runs its pipeline under NCCL's rules (an NCCL group, or "
              "TORCH_MP_CHECK_COLLECTIVES=1), where messages between two ranks are matched by "
              "order alone: a failed step can leave some queued, which the next step would take. "
              "Pass a fresh group (and, under NCCL, abort the old one)");
  if (group && group != mailbox_.group) {
    const GroupPtr& old = mailbox_.group;
    TORCH_CHECK(group->getSize() == old->getSize() && group->getRank() == old->getRank(),
                "Pipeline.reset: the new group must have this rank and size (",
                old->getRank(),
                " of ",
                old->getSize(),
                "), got ",
                group->getRank(),
                " of ",
                group->getSize());
    orphans_.groups.push_back(std::move(mailbox_.group));
    mailbox_.group = std::move(group);
  }
  abandon_in_flight();
  mailbox_.start_over();
  broken_ = false;
}

}  // namespace torch_mp::pipeline
