#pragma once
// How parameters are cut over a data-parallel group for ZeRO (docs/design.md §5.4), shared by the
// distributed optimizer (optim/parameter_shards.h) and the gradient reduce-scatter
// (sharded_state.h), which must agree on it element for element.
//
// The parameters, in order, are laid end to end in flat buckets; each bucket is padded to a
// multiple of the group size and cut into that many equal ranges; rank r owns range r of every
// bucket. A piece is one parameter's part of this rank's range.
//
//   bucket 0:  | w0 ............ | w1 ...... | b1 | pad |
//   dp = 2:    |<----- rank 0 ----->|<----- rank 1 ----->|
//   pieces of rank 0: w0 (whole), w1[0:k];  of rank 1: w1[k:], b1
//
// A bucket ends at `bucket_cap_mb`, or where the dtype, the device or the unit (ZeRO-3:
// sharded_parameters.h) changes; a parameter never straddles two buckets.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch_mp::data_parallel {

/// The elements [offset, offset + numel) of parameter `parameter` (flattened) that this rank
/// owns.
struct ShardPiece {
  size_t parameter;
  int64_t offset;
  int64_t numel;
};

/// One flat bucket.
struct ShardBucket {
  at::ScalarType dtype;
  c10::Device device;
  std::vector<size_t> parameters;     // indices of its parameters
  std::vector<int64_t> starts;        // each one's first element in the bucket
  int64_t chunk = 0;                  // elements per rank (the padded size / group size)
  std::vector<size_t> pieces;         // indices of this rank's pieces in it
  std::vector<int64_t> piece_starts;  // each piece's first element in this rank's chunk
};

/// The buckets and this rank's pieces.
struct ShardLayout {
  std::vector<ShardBucket> buckets;
  std::vector<ShardPiece> pieces;

  /// The layout of `parameters` (contiguous; raises naming one that is not, and `owner`, the
  /// class that asks) for rank `rank` of `size`, in buckets of `bucket_cap_mb`; where `units`
  /// is given (each parameter's unit), a bucket holds one unit's parameters only.
  static ShardLayout of(const std::vector<at::Tensor>& parameters,
                        int64_t size,
                        int64_t rank,
                        double bucket_cap_mb,
                        const std::string& owner,
                        const std::vector<size_t>& units = {});
};

/// Bytes of a data group's sharded state (sharded_state.h) by kind. ShardedState::bytes()
/// reports what it holds; sharded_bytes() gives what a layout holds from one step to the next,
/// the arithmetic plan::estimate counts ZeRO-2 and ZeRO-3 with.
struct ShardedBytes {
  /// grad_dtype: every bucket whole, padded (this rank's reduced range lies in it).
  int64_t main_gradients = 0;
  /// Without grad_dtype: this rank's reduced range of every bucket.
  int64_t reduced_gradients = 0;
  /// Without grad_dtype: the reduce-scatter's staging buffers. sharded_bytes() gives their
  /// bound, two of the largest bucket (one under ZeRO-3); which buckets share a buffer decides
  /// what is held.
  int64_t staging = 0;
  /// ZeRO-3: this rank's range of every bucket of parameters.
  int64_t parameter_shards = 0;

  int64_t total() const { return main_gradients + reduced_gradients + staging + parameter_shards; }
};

/// What the sharded state of `layout` over a group of `size` holds between steps: main
/// gradients in `grad_dtype` (none: the gradients in each bucket's dtype, through staging), and
/// with `shard_parameters` (ZeRO-3) the parameters' shards.
ShardedBytes sharded_bytes(const ShardLayout& layout,
                           int64_t size,
                           std::optional<at::ScalarType> grad_dtype,
                           bool shard_parameters);

/// The flat elements of a tensor, as a view where it is contiguous (detached).
at::Tensor flat_view(const at::Tensor& t);

}  // namespace torch_mp::data_parallel
