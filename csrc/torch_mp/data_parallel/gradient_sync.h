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

#include <torch/arg.h>

#include <memory>
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
  /// instead of copying gradients into the buckets and back.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Gradient compression for the all-reduce.
  TORCH_ARG(CommHook, comm_hook) = CommHook::kNone;
  /// Copy rank 0's buffers to every rank before the first forward after each synced backward.
  TORCH_ARG(bool, broadcast_buffers) = true;
};

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
  /// the buffers when a synced backward ran since the last broadcast.
  void prepare_for_forward();
  /// Arms the reduction: the next backward that accumulates into the parameters all-reduces
  /// them. Gradients accumulated by earlier backwards (under no_sync) are included.
  void prepare_for_backward();

  const GroupPtr& group() const { return group_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }

 private:
  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> buffers_;
  GroupPtr group_;
  bool broadcast_buffers_;
  bool buffers_stale_ = false;  // a synced backward ran since the buffers were broadcast
  std::shared_ptr<c10d::Reducer> reducer_;
};

/// Copies group rank 0's values of `tensors` to every rank of `group`, in place (coalesced into
/// large messages). Raises if the ranks' tensors differ in number or shape.
void broadcast_from_first_rank(const std::vector<at::Tensor>& tensors, const GroupPtr& group);

}  // namespace torch_mp::data_parallel
