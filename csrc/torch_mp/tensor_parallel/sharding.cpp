#include "torch_mp/tensor_parallel/sharding.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/nn/init.h>

#include <cmath>

#include "torch_mp/collectives.h"
#include "torch_mp/errors.h"
#include "torch_mp/mesh.h"
#include "torch_mp/tensor_parallel/linear.h"

namespace torch_mp::tensor_parallel {

void check_non_negative(int64_t size, const std::string& what) {
  TORCH_CHECK(size >= 0, what, " (", size, ") must be non-negative");
}

int64_t divide(int64_t size, int64_t parts, const std::string& what) {
  TORCH_MP_CHECK_LAYOUT(
      parts > 0, what, ": the tensor-parallel size must be positive, got ", parts);
  check_non_negative(size, what);
  TORCH_MP_CHECK_LAYOUT(size % parts == 0,
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

GroupPtr tp_group_or_default(const GroupPtr& group) { return group ? group : get_mesh()->tp_group; }

void check_shard_size(
    const char* layer, const char* what, int64_t shard, int64_t full, const GroupPtr& group) {
  TORCH_CHECK(shard * group->getSize() == full,
              layer,
              ": the weight shard has ",
              shard,
              " ",
              what,
              " but ",
              what,
              " (",
              full,
              ") split over a tensor-parallel group of size ",
              group->getSize(),
              " needs ",
              full / group->getSize(),
              " per rank (rank ",
              group->getRank(),
              "); the layer was built for a different group size");
}

void init_sharded_like_dense_(at::Tensor& weight,
                              std::optional<at::Tensor> bias,
                              int64_t shard_dim,
                              const GroupPtr& group) {
  at::NoGradGuard no_grad;
  // Draw the dense tensors in nn.Linear's / nn.Conv2d's order, then keep our shard.
  auto shape = weight.sizes().vec();
  shape[shard_dim] *= group->getSize();
  auto full_weight = at::empty(shape, weight.options());
  torch::nn::init::kaiming_uniform_(full_weight, std::sqrt(5.0));
  std::optional<at::Tensor> full_bias;
  if (bias && bias->defined()) {
    const int64_t fan_in = full_weight.numel() / std::max<int64_t>(shape[0], 1);
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    full_bias = at::empty({shape[0]}, bias->options()).uniform_(-bound, bound);
  }
  load_dense_linear_(weight, bias, full_weight, full_bias, shard_dim, group);
}

KeepDefaultRng::KeepDefaultRng()
    : state_(at::globalContext().defaultGenerator(at::kCPU).get_state()) {}

KeepDefaultRng::~KeepDefaultRng() {
  at::Generator generator = at::globalContext().defaultGenerator(at::kCPU);  // a handle
  generator.set_state(state_);
}

at::Tensor unshard(const at::Tensor& local, int64_t dim, const GroupPtr& group) {
  return comm::all_gather(local.detach(), dim, group);
}

}  // namespace torch_mp::tensor_parallel
