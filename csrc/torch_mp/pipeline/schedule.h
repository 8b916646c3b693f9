#pragma once
// Pipeline schedules as data: for every pipeline rank, the ordered list of actions it performs.
//
// A schedule for S stages over p ranks (S = p * stages_per_rank) and m micro-batches. Stages are
// placed in chunks of p: chunk c holds stages c p ... c p + p - 1, on ranks 0 ... p - 1 ("loop",
// stage s on rank s % p) or, in the "v" placement, on ranks 0 ... p - 1 for even chunks and
// p - 1 ... 0 for odd ones (with two chunks, rank r holds stages r and 2p - 1 - r, so the first
// and the last stage share rank 0). Actions name a stage and a micro-batch:
//
//   F(s,m)       forward of stage s on micro-batch m
//   B(s,m)       backward for the input gradient only (zero-bubble schedules)
//   W(s,m)       backward for the weight gradient only (after B)
//   BW(s,m)      full backward (input and weight gradients)
//   SEND_F(s,m)  send F(s,m)'s output to stage s+1     RECV_F(s,m)  receive stage s's input
//   SEND_B(s,m)  send the gradient of stage s's input  RECV_B(s,m)  receive the gradient of
//                to stage s-1                                       stage s's output
//
// 1F1B on 2 ranks, 3 micro-batches, as `to_string` writes it (communication left out here):
//
//   rank 0: F(0,0) F(0,1) BW(0,0) F(0,2) BW(0,1) BW(0,2)
//   rank 1: F(1,0) BW(1,0) F(1,1) BW(1,1) F(1,2) BW(1,2)

#include <cstdint>
#include <string>
#include <vector>

namespace torch_mp::pipeline {

/// What an action does.
enum class ActionKind : uint8_t {
  kForward,         ///< F
  kBackwardInput,   ///< B
  kBackwardWeight,  ///< W
  kFullBackward,    ///< BW
  kSendForward,     ///< SEND_F
  kRecvForward,     ///< RECV_F
  kSendBackward,    ///< SEND_B
  kRecvBackward,    ///< RECV_B
};

/// The action's name in schedule text ("F", "BW", "SEND_F", ...).
const char* kind_name(ActionKind kind);

/// True for F, B, W and BW; false for sends and receives.
bool is_compute(ActionKind kind);

/// One step of one rank: an action kind on a (stage, micro-batch).
struct Action {
  ActionKind kind;
  int64_t stage;
  int64_t microbatch;

  bool operator==(const Action& other) const = default;
  /// "F(0,3)": kind, stage, micro-batch.
  std::string to_string() const;
  /// Parses `to_string`'s form; raises on anything else.
  static Action parse(const std::string& text);
};

/// How stages are laid over the ranks (see the top of this file).
enum class Placement : uint8_t {
  kLoop,  ///< stage s on rank s % p
  kV,     ///< chunk by chunk, alternately 0 ... p - 1 and p - 1 ... 0
};

/// "loop" or "v".
const char* placement_name(Placement placement);

/// Every pipeline rank's ordered actions, and the sizes they were made for.
struct Schedule {
  /// The generator's name, or whatever a parsed file says.
  std::string name;
  int64_t num_stages = 0;
  int64_t num_microbatches = 0;
  int64_t stages_per_rank = 1;
  Placement placement = Placement::kLoop;
  /// actions[r] is what pipeline rank r does, in order.
  std::vector<std::vector<Action>> actions;

  int64_t num_ranks() const { return static_cast<int64_t>(actions.size()); }
  /// The rank that holds `stage`.
  int64_t rank_of_stage(int64_t stage) const;
  /// The stages `rank` holds, in increasing order; stage s is the rank's local stage s / p.
  std::vector<int64_t> stages_of_rank(int64_t rank) const;
  /// Text form: a header line, then "rank R: A A A ..." per rank. `parse` reads it back.
  std::string to_string() const;
  /// Reads `to_string`'s form (blank lines and lines starting with '#' other than the header
  /// are ignored). Raises, naming the line, on malformed text.
  static Schedule parse(const std::string& text);
};

/// Schedule names that `make_schedule` knows.
std::vector<std::string> schedule_names();

/// The stages each pipeline rank runs under the schedule `name` when nothing says otherwise: 2
/// for those that interleave ("interleaved_1f1b", "interleaved_zb") or fold into a V ("zbv"), 1
/// for the others. What the trainers build and the planner (plan::estimate) counts. Raises
/// torch_mp::LayoutError on an unknown name.
int64_t default_stages_per_rank(const std::string& name);

/// Generates a schedule, with its sends and receives.
///
/// Args: `name` one of "gpipe", "1f1b", "interleaved_1f1b" (needs stages_per_rank >= 2 and
/// num_microbatches divisible by the number of ranks), "zb_h1", "interleaved_zb"
/// (stages_per_rank >= 2), "zbv" (stages_per_rank = 2, "v" placement); `num_stages` the total
/// number of stages, divisible by `stages_per_rank`; the number of ranks is
/// num_stages / stages_per_rank.
/// Raises on an unknown name or sizes the schedule cannot take.
Schedule make_schedule(const std::string& name,
                       int64_t num_stages,
                       int64_t num_microbatches,
                       int64_t stages_per_rank = 1);

/// The rank of `stage` among `num_ranks` under `placement` (Schedule::rank_of_stage).
int64_t rank_of_stage(int64_t stage, int64_t num_ranks, Placement placement);

/// Adds the sends and receives that per-rank lists of compute actions need: a RECV right before
/// the compute that consumes it and a SEND right after the compute that produces it, wherever
/// neighbouring stages live on different ranks.
std::vector<std::vector<Action>> with_communication(const std::vector<std::vector<Action>>& compute,
                                                    int64_t num_stages,
                                                    Placement placement = Placement::kLoop);

}  // namespace torch_mp::pipeline
