#include "torch_mp/data_parallel/shard_layout.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_mp::data_parallel {

ShardLayout ShardLayout::of(const std::vector<at::Tensor>& parameters,
                            int64_t size,
                            int64_t rank,
                            double bucket_cap_mb,
                            const std::string& owner,
                            const std::vector<size_t>& units) {
  TORCH_CHECK_VALUE(
      bucket_cap_mb > 0, owner, ": bucket_cap_mb must be positive, got ", bucket_cap_mb);
  for (size_t i = 0; i < parameters.size(); ++i) {
    TORCH_CHECK(parameters[i].defined() && parameters[i].is_contiguous(),
                owner,
                ": parameter ",
                i,
                " (shape ",
                parameters[i].sizes(),
                ") is not contiguous; its shards would not be its elements");
  }
  ShardLayout layout;
  const auto cap_bytes = static_cast<int64_t>(bucket_cap_mb * (1 << 20));
  int64_t filled = 0;  // elements in the open bucket
  auto close = [&] {
    ShardBucket& bucket = layout.buckets.back();
    bucket.chunk = (filled + size - 1) / size;
    const int64_t first = rank * bucket.chunk;
    const int64_t last = first + bucket.chunk;
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const int64_t start = bucket.starts[j];
      const int64_t end = start + parameters[bucket.parameters[j]].numel();
      const int64_t lo = std::max(start, first);
      const int64_t hi = std::min(end, last);
      if (lo < hi) {
        bucket.pieces.push_back(layout.pieces.size());
        bucket.piece_starts.push_back(lo - first);
        layout.pieces.push_back({bucket.parameters[j], lo - start, hi - lo});
      }
    }
    filled = 0;
  };
  for (size_t i = 0; i < parameters.size(); ++i) {
    const at::Tensor& p = parameters[i];
    const bool fits = !layout.buckets.empty() && layout.buckets.back().dtype == p.scalar_type() &&
                      layout.buckets.back().device == p.device() &&
                      (units.empty() || units[i] == units[i - 1]) &&
                      (filled + p.numel()) * static_cast<int64_t>(p.element_size()) <= cap_bytes;
    if (!fits) {
      if (!layout.buckets.empty()) {
        close();
      }
      layout.buckets.push_back({p.scalar_type(), p.device(), {}, {}, 0, {}, {}});
    }
    layout.buckets.back().parameters.push_back(i);
    layout.buckets.back().starts.push_back(filled);
    filled += p.numel();
  }
  if (!layout.buckets.empty()) {
    close();
  }
  return layout;
}

ShardedBytes sharded_bytes(const ShardLayout& layout,
                           int64_t size,
                           std::optional<at::ScalarType> grad_dtype,
                           bool shard_parameters) {
  ShardedBytes bytes;
  int64_t largest = 0;
  for (const ShardBucket& bucket : layout.buckets) {
    const auto element = static_cast<int64_t>(c10::elementSize(bucket.dtype));
    const int64_t padded = bucket.chunk * size;
    if (grad_dtype) {
      bytes.main_gradients += padded * static_cast<int64_t>(c10::elementSize(*grad_dtype));
    } else {
      bytes.reduced_gradients += bucket.chunk * element;
      largest = std::max(largest, padded * element);
    }
    if (shard_parameters) {
      bytes.parameter_shards += bucket.chunk * element;
    }
  }
  bytes.staging = (shard_parameters ? 1 : 2) * largest;
  return bytes;
}

at::Tensor flat_view(const at::Tensor& t) { return t.detach().reshape({-1}); }

}  // namespace torch_mp::data_parallel
