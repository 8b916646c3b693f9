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

/// The flat elements of a tensor, as a view where it is contiguous (detached).
at::Tensor flat_view(const at::Tensor& t);

}  // namespace torch_mp::data_parallel
