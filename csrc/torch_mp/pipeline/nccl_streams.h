#pragma once
// NCCL's point-to-point semantics, for the simulator (simulate.h, comm = kNccl).
//
// - A send completes only together with its receive: both sides must have posted them.
// - Tags are ignored: the k-th message rank a sends to rank b lands in the k-th receive rank b
//   posts from rank a, whatever each was meant for.
// - Operations between two ranks run in order on one stream per rank: an operation cannot start
//   before every operation that rank posted to the same peer earlier (in either direction) has
//   completed, except that operations posted together in one group (batch_isend_irecv,
//   ncclGroupStart/End) start together.
//
//   rank 0: SEND_F(0,1) RECV_B(0,0)      ungrouped: each waits for the other's RECV, which sits
//   rank 1: SEND_B(1,0) RECV_F(1,1)      behind its own SEND on the same stream: deadlock.
//                                        grouped: both pairs match.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {

class NcclStreams {
 public:
  NcclStreams(const Schedule& schedule, double latency) : s_(schedule), latency_(latency) {}

  /// Posts rank `rank`'s SEND/RECV at `index` of its list at time `time`, in group `group`
  /// (operations of one rank posted with the same group id start together).
  void post(int64_t rank, size_t index, const Action& action, double time, int64_t group);
  /// Matches every pair of posted operations that can complete. A send that would land in a
  /// receive meant for another message is not matched; `misrouted` reports it.
  void progress();
  /// The first send found heading for a receive meant for another message, as (receiving rank,
  /// index of that receive, the receive the send is meant for); nullopt if none.
  struct Misrouted {
    int64_t rank;
    size_t index;
    Action meant_for;
    std::string message;
  };
  const std::optional<Misrouted>& misrouted() const { return misrouted_; }
  /// When rank `rank`'s operation at `index` completed, or nullopt if it has not.
  std::optional<double> completed(int64_t rank, size_t index) const;
  /// One line per stream that still holds operations: what blocks it (for deadlock reports).
  std::string pending() const;
  /// Whether every posted operation completed.
  bool idle() const;
  /// The first stream (in rank order) that is held at a send, as (rank, index of the send).
  std::optional<std::pair<int64_t, size_t>> held_send() const;

 private:
  struct Op {
    int64_t rank;
    size_t index;
    Action action;
    double posted;
    int64_t group;
    std::optional<double> done;
  };
  using Stream = std::pair<int64_t, int64_t>;  // (rank, peer)
  int64_t peer_of(const Op& op) const;
  bool startable(const Op& op) const;

  const Schedule& s_;
  double latency_;
  std::vector<Op> ops_;
  std::map<Stream, std::vector<size_t>> streams_;           // ops in posting order
  std::map<std::pair<int64_t, size_t>, size_t> by_action_;  // (rank, index) -> op
  std::map<Stream, std::vector<size_t>> sends_, recvs_;     // per direction (src, dst)
  std::map<Stream, size_t> next_send_, next_recv_;          // first unmatched
  std::optional<Misrouted> misrouted_;
};

}  // namespace torch_mp::pipeline
