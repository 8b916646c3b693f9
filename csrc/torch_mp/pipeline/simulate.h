#pragma once
// Replays a schedule with a cost model: proves it can run (no deadlock, every dependency met,
// every send received) and measures makespan, bubble and activation memory.

#include <optional>
#include <vector>

#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {

/// Time of each kind of action.
struct CostModel {
  /// F.
  double forward = 1.0;
  /// B (input gradient); BW costs backward + weight. Without `weight`, `backward` is the whole
  /// backward: BW costs backward, and a split B and W cost half of it each.
  double backward = 2.0;
  /// W (weight gradient).
  std::optional<double> weight = std::nullopt;
  /// Latency from a send to the matching receive.
  double comm = 0.0;

  /// The time `kind` takes on a rank (0 for sends and receives: they only wait).
  double cost(ActionKind kind) const;
};

/// One action as the replay ran it.
struct TimedAction {
  int64_t rank;
  Action action;
  double start;
  double end;
};

/// What `simulate` measured.
struct SimulationResult {
  /// Time from the first action to the last.
  double makespan = 0;
  /// Share of ranks x makespan not spent computing: 1 - sum(busy) / (ranks * makespan).
  double bubble_fraction = 0;
  /// Per rank, computing time.
  std::vector<double> busy;
  /// Per rank, the most micro-batches whose activations were held at once (F done, B or BW not
  /// yet), summed over the rank's stages. A micro-batch between its B and its W still holds what
  /// its weight gradient needs (in torch_mp's executor, the stage's graph); that is not counted.
  std::vector<int64_t> peak_live_microbatches;
  /// Every action with its start and end, rank by rank in schedule order.
  std::vector<TimedAction> timeline;
};

/// How sends and receives behave in the replay.
enum class CommSemantics {
  /// Gloo's: a send is buffered and completes on its own; a receive waits for its message
  /// (matched by tag).
  kGloo,
  /// NCCL's (nccl_streams.h): a send completes only with its receive, messages between two ranks
  /// are matched in order (tags ignored), and a rank's operations to one peer run in order. A
  /// rank's consecutive sends and receives are posted as one group, as the executor posts them.
  kNccl,
  /// NCCL's, every send and receive posted on its own (what one-at-a-time isend/irecv does).
  kNcclUngrouped,
};

/// Replays `schedule` under `costs`. Raises, naming the rank, the step and the action, if an
/// action sits on a rank that does not hold its stage, comes before what it depends on, or runs
/// twice; if a receive has no matching send (or a send no receive); if the ranks would deadlock
/// (under `comm`'s semantics); if, under NCCL's, a message would land in a receive meant for
/// another; or if a stage and micro-batch lacks its forward or backward.
SimulationResult simulate(const Schedule& schedule,
                          const CostModel& costs = {},
                          CommSemantics comm = CommSemantics::kGloo);

/// `schedule` reordered so that it runs under NCCL's rules (CommSemantics::kNccl):
/// - where a message would land in a receive meant for another (two ranks exchanging messages
///   of two stages, as in the "v" placement), the receive it is meant for is posted just before;
/// - while a replay gets stuck on a stream held by a lone send, that send moves past the rank's
///   next computation, into the next group of sends and receives.
/// Both moves are always valid (a receive's data and a send's tensors are kept until used); a
/// schedule that needs no change is returned as it is. Raises if a deadlock remains that no
/// such move resolves.
Schedule make_nccl_safe(Schedule schedule);

}  // namespace torch_mp::pipeline
