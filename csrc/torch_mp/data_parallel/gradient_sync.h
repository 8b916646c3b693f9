#pragma once
// The data-parallel gradient engine shared by torch_mp::DataParallel, torch_mp.DataParallel and
// the pipeline executor: c10d::Reducer (the engine behind PyTorch's DDP, exported by LibTorch)
// with its buckets, gradient hooks and overlap, driven the way DDP drives it.
//
//   forward             prepare_for_forward()      rebuilds the buckets once, in the order the
//                                                  first synced backward produced gradients
//   (more micro-batches under no_sync: gradients accumulate locally)
//   the last backward   prepare_for_backward()     arms the reducer: as each bucket's gradients
//                                                  are ready it is all-reduced (averaged over
//                                                  the group) while backward goes on; the
//                                                  reduced values are written back at its end
//   the step            check_complete()           raises, naming them, if that backward gave
//                                                  some parameters no gradient (their buckets
//                                                  were never reduced: .grad is this rank's own)

#include <torch/arg.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torch_mp/process_groups.h"

namespace c10d {
class Reducer;
}  // namespace c10d

namespace torch_mp::data_parallel {

/// How a bucket travels: as it is, or compressed to 16 bits (halving the bytes sent; the sum is
/// taken in that precision, so results differ from fp32 by its rounding).
enum class CommHook { kNone, kFp16, kBf16 };

/// Parses "none", "fp16" or "bf16"; raises on anything else.
CommHook parse_comm_hook(const std::string& name);

/// Options of GradientSync (and of DataParallel).
struct GradientSyncOptions {
  /// Size of a gradient bucket in MiB (DDP's bucket_cap_mb).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Make each `.grad` a view into its bucket (saves a copy and the memory of the gradients)
  /// instead of copying gradients into the buckets and back. (torch_mp.DataParallel sets it;
  /// LibTorch's optimizers detach_() gradients in zero_grad, which views refuse.)
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Gradient compression for the all-reduce.
  TORCH_ARG(CommHook, comm_hook) = CommHook::kNone;
  /// Copy rank 0's buffers to every rank before the first forward after each synced backward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Expert parallelism (moe/): the parameters sharded over this group (their layout says so)
  /// are a mixture of experts' experts, which differ between its ranks. They start from the
  /// values of rank 0 of `expert_data_group` and are reduced over it, divided by the size of
  /// `group`, not of it: each rank's expert gradients already sum the tokens of its expert
  /// group, so that is the average over every data rank, as the other parameters get. Unset
  /// (or a group of one rank): no parameter is treated so.
  TORCH_ARG(GroupPtr, expert_group) = {};
  /// The ranks holding the same experts (Mesh::expert_dp_group); needed with expert_group.
  TORCH_ARG(GroupPtr, expert_data_group) = {};
  /// The parameters' names (aligned with them; the module's named_parameters()), for errors.
  /// Empty: they are named by index and shape.
  TORCH_ARG(std::vector<std::string>, names) = {};
};

class ArmedBackward;
class GradientHooks;

/// Averages the gradients of `parameters` over a data-parallel group, one bucketed all-reduce
/// per synced backward, overlapped with that backward, and keeps `buffers` equal to rank 0's.
/// Both front ends' DataParallel are thin wrappers of it.
class GradientSync {
 public:
  /// Copies rank 0's parameters and buffers to every rank. Raises on every rank if the ranks'
  /// parameters or buffers differ in number, shape or dtype.
  GradientSync(std::vector<at::Tensor> parameters,
               std::vector<at::Tensor> buffers,
               GroupPtr group,
               GradientSyncOptions options = {});
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  /// Call before a forward (a no-op without autograd): rebuilds the buckets once, after the
  /// first synced backward (every rank of the group does it at the same step), and broadcasts
  /// the buffers when a synced backward ran since the last broadcast. Raises, naming them, if
  /// the last armed backward gave some parameters no gradient.
  void prepare_for_forward();
  /// Arms the reduction: the next backward that accumulates into the parameters all-reduces
  /// them. Gradients accumulated by earlier backwards (under no_sync) are included. Raises,
  /// naming them, if the last armed backward gave some parameters no gradient.
  void prepare_for_backward();
  /// Raises, naming them, if the armed backward gave some parameters a gradient but not all:
  /// their buckets were never all-reduced, so every .grad in them is this rank's own. (No
  /// find_unused_parameters: every parameter must get a gradient in a synced backward.)
  void check_complete() const;

  /// The engine that reduces `parameter`'s gradient, or null.
  static GradientSync* of(const at::Tensor& parameter);

  const GroupPtr& group() const { return group_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }

 private:
  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> buffers_;
  GroupPtr group_;
  bool broadcast_buffers_;
  bool buffers_stale_ = false;  // a synced backward ran since the buffers were broadcast
  // One reducer over `group`, and one over the expert-data group for the experts' parameters.
  std::vector<std::shared_ptr<c10d::Reducer>> reducers_;
  mutable std::mutex mutex_;  // hooks may run on the autograd engine's device threads
  std::unique_ptr<ArmedBackward> armed_;
  std::unique_ptr<GradientHooks> hooks_;
};

/// Raises, naming them, if the last armed backward of a DataParallel (either engine) that
/// reduces some of `parameters` left parameters without a gradient: what a step must check
/// before it reads the gradients.
void check_reductions_complete(const std::vector<at::Tensor>& parameters);

/// Whether `parameter`'s layout says it is sharded over `expert_group` (an expert's; see
/// GradientSyncOptions::expert_group). False without a group, or for a group of one rank.
bool is_expert_parameter(const at::Tensor& parameter, const GroupPtr& expert_group);

/// Copies group rank 0's values of `tensors` to every rank of `group`, in place (coalesced into
/// large messages). Raises if the ranks' tensors differ in number or shape.
void broadcast_from_first_rank(const std::vector<at::Tensor>& tensors, const GroupPtr& group);

}  // namespace torch_mp::data_parallel
