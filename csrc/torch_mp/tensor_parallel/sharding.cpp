#include "torch_mp/tensor_parallel/sharding.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>

#include "torch_mp/collectives.h"

namespace torch_mp::tensor_parallel {

int64_t divide(int64_t size, int64_t parts, const std::string& what) {
  TORCH_CHECK(parts > 0, what, ": the tensor-parallel size must be positive, got ", parts);
  TORCH_CHECK(size % parts == 0,
              what,
              " (",
              size,
              ") must be divisible by the tensor-parallel size (",
              parts,
              ")");
  return size / parts;
}

at::Tensor shard(const at::Tensor& full, int64_t dim, int64_t index, int64_t parts) {
  dim = c10::maybe_wrap_dim(dim, full.dim());
  const int64_t chunk =
      divide(full.size(dim), parts, "torch_mp.shard: size of dim " + std::to_string(dim));
  TORCH_CHECK(index >= 0 && index < parts, "torch_mp.shard: shard ", index, " of ", parts);
  return full.narrow(dim, index * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

at::Tensor shard(const at::Tensor& full, int64_t dim, const GroupPtr& group) {
  return shard(full, dim, group->getRank(), group->getSize());
}

at::Tensor unshard(const at::Tensor& local, int64_t dim, const GroupPtr& group) {
  return comm::all_gather(local.detach(), dim, group);
}

}  // namespace torch_mp::tensor_parallel
