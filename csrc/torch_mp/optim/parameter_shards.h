#pragma once
// How the distributed (ZeRO) optimizer cuts parameters over a data-parallel group
// (docs/design.md §5b): the parameters, in order, are laid end to end in flat buckets; each
// bucket is padded to a multiple of the group size and cut into that many equal ranges; rank r
// owns range r of every bucket and steps the elements of the parameters that fall in it.
//
//   bucket 0:  | w0 ............ | w1 ...... | b1 | pad |
//   dp = 2:    |<----- rank 0 ----->|<----- rank 1 ----->|
//   shards of rank 0: w0 (whole), w1[0:k];  of rank 1: w1[k:], b1
//
// A shard is a 1-D tensor over one parameter's owned elements: a view of the parameter (its
// updates land in place) or, with a master dtype, a copy in that dtype (fp32 masters of 16-bit
// parameters). After the local optimizer steps the shards, gather_parameters() all-gathers every
// bucket, so each rank holds the whole updated model again. Parameters never straddle buckets.
// Both front ends' DistributedOptimizer are thin wrappers of this class.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::optim {

/// Options of ParameterShards (and of DistributedOptimizer).
struct ParameterShardsOptions {
  /// Size of a flat bucket in MiB (a parameter larger than that gets a bucket of its own).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Keep the shards as copies in this dtype (fp32 master weights of 16-bit parameters): their
  /// gradients are converted to it, and the stepped values written back rounded. None (or the
  /// parameters' own dtype): the shards are views of the parameters.
  TORCH_ARG(std::optional<at::ScalarType>, master_dtype) = std::nullopt;
};

/// One shard: the elements [offset, offset + numel) of parameter `parameter` (flattened).
struct ShardPiece {
  size_t parameter;
  int64_t offset;
  int64_t numel;
};

/// The parameters of one data-parallel group, cut into flat buckets and owned range by range
/// (see the top of this file).
class ParameterShards {
 public:
  /// Raises on every rank if the ranks' parameters differ in number, shape or dtype, and if a
  /// parameter is not contiguous (its flat view would not be its elements).
  ParameterShards(std::vector<at::Tensor> parameters,
                  GroupPtr group,
                  ParameterShardsOptions options = {});

  /// The 1-D tensors this rank steps, one per piece (views, or masters in master_dtype).
  const std::vector<at::Tensor>& shards() const { return shards_; }
  /// Which elements of which parameter each shard covers.
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  const GroupPtr& group() const { return group_; }
  /// How many flat buckets the parameters fill.
  size_t num_buckets() const { return buckets_.size(); }

  /// Points each shard's `.grad` at its parameter's gradient elements (converted to the master
  /// dtype, when there is one); a parameter without a gradient leaves its shards without one.
  void take_gradients();
  /// Drops the shards' `.grad` (they hold the parameters' gradients alive).
  void release_gradients();
  /// Writes master shards back into their parameters (rounded), then all-gathers every bucket,
  /// so every rank holds every rank's updated elements. Collective over the group.
  void gather_parameters();

  /// The whole-parameter tensors of per-shard ones (aligned with shards(); an undefined entry
  /// counts as zeros), each shaped as its parameter and in its shards' dtype: how the
  /// optimizer's per-shard state becomes the state of a plain optimizer. Collective over the
  /// group.
  std::vector<at::Tensor> gather(const std::vector<at::Tensor>& per_shard) const;
  /// This rank's pieces of whole-parameter tensors (aligned with parameters(); an undefined
  /// entry gives undefined pieces), each a 1-D copy: the inverse of gather.
  std::vector<at::Tensor> slice(const std::vector<at::Tensor>& per_parameter) const;

 private:
  struct Bucket {
    at::ScalarType dtype;        // of its parameters
    at::ScalarType shard_dtype;  // of its shards (the master dtype, if any)
    c10::Device device;
    std::vector<size_t> parameters;     // indices into parameters_
    std::vector<int64_t> starts;        // each one's first element in the bucket
    int64_t chunk;                      // elements per rank (the padded size / group size)
    std::vector<size_t> pieces;         // indices into pieces_ of this rank's shards in it
    std::vector<int64_t> piece_starts;  // each shard's first element in this rank's chunk
  };

  // The bucket's elements of every rank: this rank's from `per_shard` (in `dtype`; zeros where
  // undefined, and in the padding), the others' received.
  at::Tensor gather_bucket(const Bucket& bucket,
                           const std::vector<at::Tensor>& per_shard,
                           at::ScalarType dtype) const;

  std::vector<at::Tensor> parameters_;
  GroupPtr group_;
  bool masters_;
  std::vector<Bucket> buckets_;
  std::vector<ShardPiece> pieces_;
  std::vector<at::Tensor> shards_;
};

}  // namespace torch_mp::optim
