#include "torch_mp/optim/parameter_shards.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"

namespace torch_mp::optim {
namespace {

// The flat elements of a parameter (or its gradient), as a view where it is contiguous.
at::Tensor flat(const at::Tensor& t) { return t.detach().reshape({-1}); }

}  // namespace

ParameterShards::ParameterShards(std::vector<at::Tensor> parameters,
                                 GroupPtr group,
                                 ParameterShardsOptions options)
    : parameters_(std::move(parameters)), group_(std::move(group)) {
  TORCH_CHECK(group_, "DistributedOptimizer: no data-parallel group");
  TORCH_CHECK(options.bucket_cap_mb() > 0,
              "DistributedOptimizer: bucket_cap_mb must be positive, got ",
              options.bucket_cap_mb());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    TORCH_CHECK(parameters_[i].defined() && parameters_[i].is_contiguous(),
                "DistributedOptimizer: parameter ",
                i,
                " (shape ",
                parameters_[i].sizes(),
                ") is not contiguous; its shards would not be its elements");
  }
  comm::check_same_tensors_across_ranks(
      parameters_, group_, "DistributedOptimizer: the parameters of the data-parallel ranks");

  const auto cap_bytes = static_cast<int64_t>(options.bucket_cap_mb() * (1 << 20));
  const int64_t size = group_->getSize();
  const int64_t rank = group_->getRank();
  masters_ = false;
  int64_t filled = 0;  // elements in the open bucket
  auto close = [&] {
    if (buckets_.empty() || buckets_.back().chunk >= 0) {
      return;
    }
    Bucket& bucket = buckets_.back();
    bucket.chunk = (filled + size - 1) / size;
    const int64_t first = rank * bucket.chunk;
    const int64_t last = first + bucket.chunk;
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const int64_t start = bucket.starts[j];
      const int64_t end = start + parameters_[bucket.parameters[j]].numel();
      const int64_t lo = std::max(start, first);
      const int64_t hi = std::min(end, last);
      if (lo < hi) {
        bucket.pieces.push_back(pieces_.size());
        bucket.piece_starts.push_back(lo - first);
        pieces_.push_back({bucket.parameters[j], lo - start, hi - lo});
      }
    }
    filled = 0;
  };
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const at::Tensor& p = parameters_[i];
    const bool fits = !buckets_.empty() && buckets_.back().dtype == p.scalar_type() &&
                      buckets_.back().device == p.device() &&
                      (filled + p.numel()) * static_cast<int64_t>(p.element_size()) <= cap_bytes;
    if (!fits) {
      close();
      const auto master = options.master_dtype();
      buckets_.push_back({p.scalar_type(),
                          master ? *master : p.scalar_type(),
                          p.device(),
                          {},
                          {},
                          /*chunk=*/-1,
                          {},
                          {}});
    }
    buckets_.back().parameters.push_back(i);
    buckets_.back().starts.push_back(filled);
    filled += p.numel();
  }
  close();

  const auto master = options.master_dtype();
  for (const ShardPiece& piece : pieces_) {
    const at::Tensor& p = parameters_[piece.parameter];
    at::Tensor view = flat(p).narrow(0, piece.offset, piece.numel);
    if (master && *master != p.scalar_type()) {
      masters_ = true;
      shards_.push_back(view.to(*master, /*non_blocking=*/false, /*copy=*/true));
    } else {
      shards_.push_back(view);
    }
  }
}

void ParameterShards::take_gradients() {
  for (size_t s = 0; s < pieces_.size(); ++s) {
    const at::Tensor& grad = parameters_[pieces_[s].parameter].grad();
    at::Tensor& target = shards_[s].mutable_grad();
    if (!grad.defined()) {
      target.reset();
      continue;
    }
    at::Tensor piece = flat(grad).narrow(0, pieces_[s].offset, pieces_[s].numel);
    target = masters_ ? piece.to(shards_[s].scalar_type()) : piece;
  }
}

void ParameterShards::release_gradients() {
  for (auto& shard : shards_) {
    shard.mutable_grad().reset();
  }
}

void ParameterShards::gather_parameters() {
  at::NoGradGuard no_grad;
  if (masters_) {
    for (size_t s = 0; s < pieces_.size(); ++s) {
      const ShardPiece& piece = pieces_[s];
      flat(parameters_[piece.parameter]).narrow(0, piece.offset, piece.numel).copy_(shards_[s]);
    }
  }
  if (group_->getSize() == 1) {
    return;  // the shards are the whole parameters
  }
  std::vector<at::Tensor> own;
  own.reserve(pieces_.size());
  for (const ShardPiece& piece : pieces_) {
    own.push_back(flat(parameters_[piece.parameter]).narrow(0, piece.offset, piece.numel));
  }
  for (const Bucket& bucket : buckets_) {
    const at::Tensor all = gather_bucket(bucket, own, bucket.dtype);
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const at::Tensor& p = parameters_[bucket.parameters[j]];
      flat(p).copy_(all.narrow(0, bucket.starts[j], p.numel()));
    }
  }
}

at::Tensor ParameterShards::gather_bucket(const Bucket& bucket,
                                          const std::vector<at::Tensor>& per_shard,
                                          at::ScalarType dtype) const {
  const auto options = at::TensorOptions().dtype(dtype).device(bucket.device);
  at::Tensor mine = at::zeros({bucket.chunk}, options);
  for (size_t k = 0; k < bucket.pieces.size(); ++k) {
    const at::Tensor& value = per_shard[bucket.pieces[k]];
    if (value.defined()) {
      mine.narrow(0, bucket.piece_starts[k], value.numel()).copy_(value.reshape({-1}));
    }
  }
  at::Tensor all = at::empty({bucket.chunk * group_->getSize()}, options);
  comm::all_gather_into(all, mine, group_);
  return all;
}

std::vector<at::Tensor> ParameterShards::gather(const std::vector<at::Tensor>& per_shard) const {
  TORCH_CHECK(per_shard.size() == pieces_.size(),
              "ParameterShards::gather: ",
              per_shard.size(),
              " tensors for ",
              pieces_.size(),
              " shards");
  std::vector<at::Tensor> whole(parameters_.size());
  for (const Bucket& bucket : buckets_) {
    const at::Tensor all = gather_bucket(bucket, per_shard, bucket.shard_dtype);
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const at::Tensor& p = parameters_[bucket.parameters[j]];
      whole[bucket.parameters[j]] = all.narrow(0, bucket.starts[j], p.numel()).view(p.sizes());
    }
  }
  return whole;
}

std::vector<at::Tensor> ParameterShards::slice(const std::vector<at::Tensor>& per_parameter) const {
  TORCH_CHECK(per_parameter.size() == parameters_.size(),
              "ParameterShards::slice: ",
              per_parameter.size(),
              " tensors for ",
              parameters_.size(),
              " parameters");
  std::vector<at::Tensor> pieces;
  pieces.reserve(pieces_.size());
  for (const ShardPiece& piece : pieces_) {
    const at::Tensor& value = per_parameter[piece.parameter];
    if (!value.defined()) {
      pieces.emplace_back();
      continue;
    }
    TORCH_CHECK(value.numel() == parameters_[piece.parameter].numel(),
                "DistributedOptimizer: a state tensor of parameter ",
                piece.parameter,
                " has ",
                value.numel(),
                " elements, the parameter ",
                parameters_[piece.parameter].numel());
    pieces.push_back(flat(value).narrow(0, piece.offset, piece.numel).clone());
  }
  return pieces;
}

}  // namespace torch_mp::optim
