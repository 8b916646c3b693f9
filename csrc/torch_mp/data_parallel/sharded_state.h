#pragma once
// The sharded state of one data-parallel group, and its one owner: what
// DataParallel(shard_gradients=True), DataParallel(grad_dtype=...) and
// DataParallel(shard_parameters=True) make, and what the DistributedOptimizer, clip_grad_norm_,
// GradScaler and checkpoints are handed (DataParallel::sharded_state(), or the one lookup of
// owners.h from the parameters). It holds the ShardLayout, the flat buckets of main gradients
// (of any grad_dtype), this rank's reduce-scattered range of each, the staging of the
// reduce-scatter, and (ZeRO-3) the parameters' shards and gathers (sharded_parameters.h); the
// distributed optimizer's fp32 masters cover this rank's pieces of its layout. Gradients are
// reduce-scattered over the group so that each rank keeps the averaged gradient of its own range
// only (ZeRO-2), in the flat buckets of shard_layout.h, which the DistributedOptimizer steps
// (docs/design.md §5.4).
//
//   every backward     (grad_dtype) each parameter's new gradient is added into an fp32 main
//                      gradient bucket and dropped from .grad, micro-batch after micro-batch
//   synced backward    as the last parameter of a bucket gets its gradient, the bucket (the main
//                      gradients, or the .grads copied out and dropped) is divided by the group
//                      size and reduce-scattered, while backward goes on (with grad_dtype into
//                      this rank's own range of the main gradients, in place: the main
//                      gradients and their shard are one buffer, 4 bytes per parameter)
//   optimizer step     the DistributedOptimizer reads this rank's pieces (piece_gradient), then
//                      release() drops them
//   zero_grad          (the DistributedOptimizer's or the DataParallel's) drops the reduced
//                      gradients and the main gradients that backwards added since
//
// After a synced backward the parameters' .grad are None: the averaged gradients are here, and
// only a DistributedOptimizer (and clip_grad_norm_) reads them. Every parameter must get a
// gradient in a synced backward (there is no find_unused_parameters); one that did not is named
// at the next step, by the module's name for it.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/data_parallel/shard_layout.h"
#include "torch_mp/process_groups.h"

namespace c10d {
class Work;
}  // namespace c10d

namespace torch_mp::data_parallel {

/// Options of ShardedState.
struct ShardedStateOptions {
  /// Size of a flat bucket in MiB (it is also the DistributedOptimizer's).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Accumulate and reduce in this dtype (fp32 main gradients of 16-bit parameters); None: in
  /// the parameters' dtype, from their .grad.
  TORCH_ARG(std::optional<at::ScalarType>, grad_dtype) = std::nullopt;
  /// Copy rank 0's buffers to every rank before the first forward after each synced backward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// The parameters' names (aligned with them), for errors; empty: by index and shape.
  TORCH_ARG(std::vector<std::string>, names) = {};
  /// Shard the parameters too (ZeRO-3, sharded_parameters.h), in these units: each
  /// parameter's (aligned with them), unit 0 being the whole module's.
  TORCH_ARG(bool, shard_parameters) = false;
  TORCH_ARG(std::vector<size_t>, units) = {};
};

class ArmedBackward;
class GradientHooks;
class ShardedParameters;

/// Reduce-scatters the gradients of `parameters` over a data-parallel group (see the top of the
/// file). Made by create(): its gradient hooks hold it weakly.
class ShardedState : public std::enable_shared_from_this<ShardedState> {
 public:
  /// Copies rank 0's parameters and buffers to every rank. Raises on every rank if the ranks'
  /// parameters or buffers differ in number, shape or dtype.
  static std::shared_ptr<ShardedState> create(std::vector<at::Tensor> parameters,
                                              std::vector<at::Tensor> buffers,
                                              GroupPtr group,
                                              ShardedStateOptions options = {});
  ~ShardedState();
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;

  /// The engine that reduces `parameter`'s gradient, or null.
  static std::shared_ptr<ShardedState> of(const at::Tensor& parameter);

  /// Call before a forward: broadcasts the buffers when a synced backward ran since the last
  /// broadcast (as GradientSync does).
  void prepare_for_forward();
  /// Arms the reduction: the next backward that accumulates into the parameters reduce-scatters
  /// them (gradients accumulated by earlier backwards included). Raises if the gradients the
  /// last synced backward reduced were never stepped or dropped by a DistributedOptimizer: a
  /// plain optimizer would have stepped nothing (LibTorch has no step hook to refuse it).
  void prepare_for_backward();

  /// This rank's averaged gradient of piece `piece` of the layout (1-D, in the gradient dtype);
  /// undefined before a synced backward. Raises, naming the parameters, if the last synced
  /// backward left some without a gradient.
  at::Tensor piece_gradient(size_t piece) const;
  /// Drops the reduced gradients (after the optimizer step that read them).
  void release();
  /// Drops the reduced gradients and zeros the main gradients (grad_dtype) that backwards
  /// since the last synced one added: a zero_grad of the optimizer or the module.
  void zero_grad();
  /// Raises, naming them, if an armed reduction is missing parameters' gradients.
  void check_complete() const;

  // ---- ZeRO-3 (shard_parameters): see sharded_parameters.h ----
  bool shards_parameters() const { return sharded_ != nullptr; }
  /// How many units (0 without shard_parameters).
  size_t num_units() const;
  /// Unit u's parameters, whole, before its forward (and the next unit's on their way).
  void before_forward(size_t unit);
  /// Unit u's parameters freed after its forward.
  void after_forward(size_t unit);
  /// Unit u's parameters, whole, before its backward.
  void before_backward(size_t unit);
  /// Every unit's parameters whole (for checkpoints), until free_parameters or write_back.
  void gather_parameters();
  /// Every unit's parameters freed: after a step has written their shards, the next use
  /// gathers the new values.
  void free_parameters();
  /// This rank's range of every gathered parameter copied back into its shard (whole
  /// parameters were written: a checkpoint loaded), then every unit freed.
  void write_back_parameters();
  /// Parameter i's shape (its data is empty between uses under shard_parameters).
  std::vector<int64_t> parameter_shape(size_t parameter) const;
  /// This rank's elements of piece `piece` (1-D, a view of the shard the step updates).
  at::Tensor parameter_piece(size_t piece) const;

  /// The bytes it holds now, by kind (sharded_bytes gives what its layout holds between steps).
  ShardedBytes bytes() const;

  const ShardLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  /// Parameter i's name (or index) and shape, for errors.
  std::string name(size_t i) const;
  const GroupPtr& group() const { return group_; }
  double bucket_cap_mb() const { return bucket_cap_mb_; }
  /// The dtype the gradients are reduced in: grad_dtype, or that of the parameters.
  at::ScalarType gradient_dtype(const at::Tensor& parameter) const {
    return grad_dtype_.value_or(parameter.scalar_type());
  }

 private:
  ShardedState(std::vector<at::Tensor> parameters,
               std::vector<at::Tensor> buffers,
               GroupPtr group,
               ShardedStateOptions options);
  void register_hooks();
  void on_gradient(size_t parameter);  // after AccumulateGrad of `parameter`
  void launch(size_t bucket);
  void finish();

  struct Pending {
    size_t bucket;
    int staging;        // the staging buffer it reads (-1: the main gradients, or done)
    at::Tensor output;  // this rank's range of the sum
    c10::intrusive_ptr<c10d::Work> work;  // null once complete
    at::Tensor summed;  // all-reduced (Gloo) into staging: this rank's range, for the output
  };
  // A staging buffer of `numel` elements (without grad_dtype, the bucket's gradients are copied
  // into one and sent from it), kept from bucket to bucket and step to step: allocating one per
  // bucket cost ~30 % of a step in page faults. Completes the bucket still sending from it.
  at::Tensor staging_buffer(int slot, int64_t numel, const at::TensorOptions& options);
  void complete(Pending& pending);  // waits for its reduce-scatter; its range is then reduced

  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> buffers_;
  GroupPtr group_;
  bool broadcast_buffers_;
  bool buffers_stale_ = false;
  double bucket_cap_mb_;
  std::optional<at::ScalarType> grad_dtype_;
  ShardLayout layout_;
  std::vector<bool> all_reduced_;     // each bucket's sum: all-reduced (on Gloo), else scattered
  std::vector<size_t> bucket_of_;     // each parameter's bucket
  std::vector<int64_t> start_of_;     // and its first element in it
  std::vector<size_t> piece_bucket_;  // each piece's bucket
  std::vector<int64_t> piece_start_;  // and its first element in this rank's range of it
  std::unique_ptr<GradientHooks> hooks_;
  std::vector<size_t> units_;                   // (shard_parameters) each parameter's unit
  std::unique_ptr<ShardedParameters> sharded_;  // (shard_parameters)
  std::vector<at::Tensor> main_;                // (grad_dtype) each bucket's main gradients, padded
  bool main_dirty_ = false;  // something was added to them since they were zeroed
  // Each bucket's reduced range (with grad_dtype a view of main_, else shard_); undefined
  // while none is held.
  std::vector<at::Tensor> reduced_;
  std::vector<at::Tensor> shard_;      // (no grad_dtype) where each bucket's range is received
  std::array<at::Tensor, 2> staging_;  // two: a bucket is copied while the last one is sent
  size_t next_staging_ = 0;

  mutable std::mutex mutex_;  // hooks may run on the autograd engine's device threads
  std::unique_ptr<ArmedBackward> armed_;
  std::vector<size_t> ready_count_;  // per bucket, in the armed backward
  std::vector<Pending> pending_;
  size_t launched_ = 0;
};

/// While it lives, the parameters among `parameters` that a DataParallel(shard_parameters=True)
/// shards are whole (every unit of each such DataParallel gathered): what checkpoints read and
/// write through. Collective over those DataParallels' groups; nothing sharded: does nothing.
/// With `write_back`, what was written into them is kept (each rank keeps its range) when it
/// ends.
class WholeParameters {
 public:
  WholeParameters(const std::vector<at::Tensor>& parameters, bool write_back = false);
  ~WholeParameters() noexcept(false);
  WholeParameters(WholeParameters&& other) noexcept = default;
  WholeParameters(const WholeParameters&) = delete;
  WholeParameters& operator=(const WholeParameters&) = delete;
  WholeParameters& operator=(WholeParameters&&) = delete;
  /// Whether anything was gathered (then tensors read meanwhile are freed with it: copy them).
  bool gathered() const { return !engines_.empty(); }
  /// Ends it now (what the destructor does otherwise).
  void release();

 private:
  std::vector<std::shared_ptr<ShardedState>> engines_;
  bool write_back_;
};

/// The former names of ShardedState and its options.
using ShardedGradientSync = ShardedState;
using ShardedGradientSyncOptions = ShardedStateOptions;

}  // namespace torch_mp::data_parallel
