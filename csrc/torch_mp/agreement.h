#pragma once
// The ranks of a group agree: on a configuration, on a text, on a replicated tensor, and on
// whether any of them failed (the cross-rank failure machinery the core's areas share).
//
// A bad value on one rank must raise on every rank: a check that failed on one rank alone would
// leave the others waiting in their next collective. Each check therefore exchanges what it
// compares first (one small all-gather) and raises on every rank, naming what each rank holds.
// Likewise problems one rank finds (raise_anywhere): each rank collects what went wrong on it,
// and one exchange tells every rank whether any rank has problems, and which rank's to report.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp {

/// Turns the collective checks on or off (default: on when the environment variable
/// TORCH_MP_CHECK_COLLECTIVES is 1). When on, every all-reduce, all-gather and reduce-scatter
/// first compares the ranks' dtypes and shapes, and the tensor-parallel entry points that take a
/// replicated tensor (copy_to_tp, the ids of VocabParallelEmbedding, the targets of
/// vocab_parallel_cross_entropy) compare its values: a rank with another shape, dtype or batch
/// raises on every rank, naming each rank's tensor, instead of aborting the process inside Gloo or
/// returning numbers computed from mismatched data. Costs one small all-gather per collective
/// (and a pass over replicated inputs).
void set_check_collectives(bool on);
/// Whether the collective checks are on.
bool check_collectives();

/// An exception's message without the backtrace c10 errors carry.
std::string text_of(const std::exception& e);

/// What a problem without a text is reported as (an empty one would read as none on the others).
inline constexpr const char* kNoMessage = "(an error without a message)";

/// Runs `body`, turning an exception into one of `problems` (which raise_anywhere then reports
/// on every rank: a rank that raised alone would leave the others waiting).
template <typename Body>
void collect_problems(std::vector<std::string>& problems, const Body& body) {
  try {
    body();
  } catch (const std::exception& e) {
    const auto text = text_of(e);
    problems.push_back(text.empty() ? kNoMessage : text);
  }
}

/// Raises on every rank of `group` (this rank only when `group` is null) if any rank has
/// `problems`: "<what> on rank <r>: <its problems>", this rank's own if it has any.
void raise_anywhere(const std::vector<std::string>& problems,
                    const std::string& what,
                    const GroupPtr& group);

/// What raise_anywhere raises, without raising it: the text of the first rank of `group` with
/// problems (this rank's own if it has some), or nullopt when no rank has any. Collective over
/// `group` (may be null).
std::optional<std::string> failure_anywhere(const std::vector<std::string>& problems,
                                            const std::string& what,
                                            const GroupPtr& group);

/// Up to eight of `items` joined by "; ", and how many more there are.
std::string summary_of(const std::vector<std::string>& items);

namespace comm {

/// A double as the int64 of its bits, for comparing settings with check_same_across_ranks.
int64_t bits(double value);

/// Raises on every rank, naming the ranks that disagree, unless `values` is the same on all
/// ranks of the group. `what` names the values in the message.
void check_same_across_ranks(const std::vector<int64_t>& values,
                             const GroupPtr& group,
                             const std::string& what);

/// One value of a configuration compared across ranks (check_same_values_across_ranks).
struct NamedValue {
  std::string name;
  /// What is compared: the value, or the bits or a digest of one that is not an integer.
  int64_t compared;
  /// The value as this rank shows it in the message.
  std::string shown;
  /// Whether `compared` is the value itself (then every rank's is shown).
  bool numeric;
};

/// Raises on every rank unless `values` are the same on all ranks of the group, naming each
/// value that differs, this rank's value of it and, for numbers, every rank's. `what` names the
/// configuration ("ParallelMLP configuration").
void check_same_values_across_ranks(const std::vector<NamedValue>& values,
                                    const GroupPtr& group,
                                    const std::string& what);

/// Raises on every rank, quoting each rank's `text`, unless `text` is the same on all ranks of
/// the group (compared in full through a digest; quoted up to 200 characters).
void check_same_text_across_ranks(const std::string& text,
                                  const GroupPtr& group,
                                  const std::string& what);

/// With the collective checks on (check_collectives), raises on every rank unless `x` is the
/// same on every rank of the group (dtype, shape and values); `what` names it. A tensor without
/// values (torch.compile traces with fake tensors) is not compared.
void check_replicated(const at::Tensor& x, const GroupPtr& group, const std::string& what);

/// Raises on every rank unless `tensors` have the same count, dtypes and shapes on all ranks of
/// the group (one fixed-size exchange: the count and a digest of the rest).
void check_same_tensors_across_ranks(const std::vector<at::Tensor>& tensors,
                                     const GroupPtr& group,
                                     const std::string& what);

/// With the collective checks on, raises on every rank unless the ranks' `x` have the same dtype
/// and shape (before collective `op` on them), and raises unless `x` lives where `group`'s
/// tensors do (check_device).
void check_operands(const at::Tensor& x, const GroupPtr& group, const char* op);

/// With the collective checks on, raises, naming `op`, the rank and both devices, unless `x`
/// lives on `group`'s device (device_of: CUDA for an NCCL group, the CPU otherwise). A Gloo
/// run with the checks on thus catches a tensor that an NCCL group could not carry.
void check_device(const at::Tensor& x, const GroupPtr& group, const char* op);

}  // namespace comm
}  // namespace torch_mp
