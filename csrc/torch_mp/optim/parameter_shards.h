#pragma once
// The distributed (ZeRO) optimizer's view of the parameters of one data-parallel group: the flat
// buckets of data_parallel/shard_layout.h, and for each piece this rank owns a shard, the 1-D
// tensor the local optimizer steps: a view of the parameter's elements (its updates land in
// place) or, with a master dtype, a copy in that dtype (fp32 masters of 16-bit parameters).
// Their gradients are the parameters' (averaged by DataParallel: ZeRO-1), or this rank's range
// of the reduce-scatter of a DataParallel that shards gradients (ZeRO-2,
// data_parallel/sharded_state.h). After the local optimizer steps the shards,
// gather_parameters() all-gathers every bucket, so each rank holds the whole updated model. Over
// more than one rank the buckets are the parameters' storage: each parameter becomes a view of
// its range of one flat tensor per bucket (the same tensor to autograd, modules and optimizers),
// which the all-gather fills in place.
// Both front ends' DistributedOptimizer are thin wrappers of this class.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/data_parallel/owners.h"
#include "torch_mp/data_parallel/shard_layout.h"
#include "torch_mp/process_groups.h"

namespace c10d {
class Work;
}  // namespace c10d

namespace torch_mp::data_parallel {
class ShardedState;
}  // namespace torch_mp::data_parallel

namespace torch_mp::optim {

/// Options of ParameterShards (and of DistributedOptimizer).
struct ParameterShardsOptions {
  /// Size of a flat bucket in MiB (a parameter larger than that gets a bucket of its own). A
  /// DataParallel that shards the gradients decides it instead: its buckets are these.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Keep the shards as copies in this dtype (fp32 master weights of 16-bit parameters): their
  /// gradients are converted to it, and the stepped values written back rounded. None (or the
  /// parameters' own dtype): the shards are views of the parameters.
  TORCH_ARG(std::optional<at::ScalarType>, master_dtype) = std::nullopt;
  /// The mesh's expert group: parameters sharded over it (a mixture of experts' experts) are
  /// refused, not sharded (yet).
  TORCH_ARG(GroupPtr, expert_group) = {};
  /// The parameters' names (aligned with them), for errors; empty: by index and shape.
  TORCH_ARG(std::vector<std::string>, names) = {};
  /// Let gather_parameters() return with the all-gathers still running (Megatron's
  /// --overlap-param-gather): each bucket is waited for before the first forward that uses
  /// it (wait_for_gathers, which DataParallel calls), or by wait_for_parameters(), or by this
  /// class's next use. Until then the parameters hold other ranks' ranges of the last step.
  TORCH_ARG(bool, overlap_param_gather) = false;
  /// The sharded state of the DataParallel that reduces these parameters' gradients
  /// (DataParallel::sharded_state()); null: the one the parameters belong to, if any
  /// (data_parallel/owners.h). It must hold exactly these parameters, in its order.
  TORCH_ARG(std::shared_ptr<data_parallel::ShardedState>, sharded_state) = {};
};

using data_parallel::ShardPiece;

/// The parameters of one data-parallel group, cut into flat buckets and owned range by range
/// (see the top of this file).
class ParameterShards : public data_parallel::ParameterGathers {
 public:
  ~ParameterShards() override;
  ParameterShards(const ParameterShards&) = delete;
  ParameterShards& operator=(const ParameterShards&) = delete;
  /// Raises on every rank if the ranks' parameters differ in number, shape or dtype, and if a
  /// parameter is not contiguous (its flat view would not be its elements). Over more than one
  /// rank, moves the parameters' data into the flat buckets (see the top of the file). Parameters
  /// whose gradients a DataParallel(shard_gradients=True) reduces must be all of its parameters, in
  /// its order.
  ParameterShards(std::vector<at::Tensor> parameters,
                  GroupPtr group,
                  ParameterShardsOptions options = {});

  /// The 1-D tensors this rank steps, one per piece (views, or masters in master_dtype).
  const std::vector<at::Tensor>& shards() const { return shards_; }
  /// Which elements of which parameter each shard covers.
  const std::vector<ShardPiece>& pieces() const { return layout_.pieces; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  /// Parameter i's shape (under a DataParallel(shard_parameters=True) its data is empty
  /// between uses: ZeRO-3).
  std::vector<int64_t> shape(size_t parameter) const;
  const GroupPtr& group() const { return group_; }
  /// How many flat buckets the parameters fill.
  size_t num_buckets() const { return layout_.buckets.size(); }
  /// The DataParallel engine whose reduce-scatter gives the shards' gradients, or null (then
  /// they are the parameters' .grad).
  const std::shared_ptr<data_parallel::ShardedState>& gradients() const { return gradients_; }

  /// Points each shard's `.grad` at its averaged gradient elements (converted to the shard's
  /// dtype where they differ); a parameter without a gradient leaves its shards without one.
  /// Raises on every rank of a group of more than one, naming it, for a parameter whose
  /// gradient nothing averages over the group (no DataParallel or DistributedDataParallel
  /// holds it), and for one that the last synced backward gave no gradient: stepping either
  /// would step this rank's own gradient, and the replicas would drift apart. Raises too if a
  /// parameter's data was replaced since construction (module.to(...)): the step would miss it.
  /// First, master shards follow their parameters where those were written from outside
  /// since the last step (follow_parameters).
  void take_gradients();
  /// Each master element whose parameter no longer holds it rounded (the parameter was
  /// written from outside: a checkpoint or state dict loaded into the model, an edit) takes
  /// the parameter's value: a step never writes stale masters over loaded parameters.
  void follow_parameters();
  /// Drops the shards' `.grad` (and a sharding DataParallel's reduced gradients, once stepped).
  void release_gradients();
  /// release_gradients(), and a sharding DataParallel's main gradients zeroed: zero_grad.
  void zero_gradients();
  /// Writes master shards back into their parameters (rounded), then all-gathers every bucket
  /// (all posted, then waited for, unless overlap_param_gather), so every rank holds every
  /// rank's updated elements. Collective over the group. Under ZeRO-3 (the parameters sharded
  /// by their DataParallel) nothing is gathered: each unit's next use gathers it.
  void gather_parameters();
  /// Waits for the all-gathers gather_parameters() left running (overlap_param_gather).
  void wait_for_parameters() const;
  /// Waits for bucket `bucket`'s all-gather, if it is still running.
  void wait_for_bucket(size_t bucket) const override;
  /// How many buckets' all-gathers have not been waited for yet.
  size_t pending_gathers() const;

  /// The whole-parameter tensors of per-shard ones (aligned with shards(); an undefined entry
  /// counts as zeros), each shaped as its parameter and in its shards' dtype: how the
  /// optimizer's per-shard state becomes the state of a plain optimizer. Collective over the
  /// group.
  std::vector<at::Tensor> gather(const std::vector<at::Tensor>& per_shard) const;
  /// This rank's pieces of whole-parameter tensors (aligned with parameters(); an undefined
  /// entry gives undefined pieces), each a 1-D copy: the inverse of gather.
  std::vector<at::Tensor> slice(const std::vector<at::Tensor>& per_parameter) const;

 private:
  // The bucket's elements of every rank: this rank's from `per_shard` (in `dtype`; zeros where
  // undefined, and in the padding), the others' received.
  at::Tensor gather_bucket(const data_parallel::ShardBucket& bucket,
                           const std::vector<at::Tensor>& per_shard,
                           at::ScalarType dtype) const;
  at::ScalarType shard_dtype(const data_parallel::ShardBucket& bucket) const;
  // This rank's elements of piece s of the parameters (a 1-D view).
  at::Tensor piece_of_parameter(size_t s) const;

  std::vector<at::Tensor> parameters_;
  GroupPtr group_;
  std::vector<std::string> names_;
  std::optional<at::ScalarType> master_dtype_;
  bool masters_ = false;
  bool sharded_ = false;  // a DataParallel(shard_parameters=True) holds the parameters
  data_parallel::ShardLayout layout_;
  std::vector<at::Tensor> flat_;  // each bucket's storage of its parameters (groups of > 1)
  bool overlap_param_gather_ = false;
  // The all-gather still filling each bucket (overlap_param_gather), or null.
  mutable std::vector<c10::intrusive_ptr<c10d::Work>> gathering_;
  std::vector<const void*> data_of_;  // where each parameter's data lives (checked at a step)
  std::vector<at::Tensor> shards_;
  std::shared_ptr<data_parallel::ShardedState> gradients_;
};

/// Waits for the all-gathers still filling the buckets that hold any of `parameters` (a
/// DistributedOptimizer's with overlap_param_gather), so that they hold the last step's values:
/// what a forward calls before it uses them (data_parallel/owners.h). Nothing pending: returns
/// at once.
using data_parallel::wait_for_gathers;

}  // namespace torch_mp::optim
