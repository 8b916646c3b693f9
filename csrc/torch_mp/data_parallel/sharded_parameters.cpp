#include "torch_mp/data_parallel/sharded_parameters.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <utility>

#include "torch_mp/comm.h"

namespace torch_mp::data_parallel {
namespace {

// Gives `t`'s storage `bytes` bytes of fresh memory (its elements undefined), or none: the
// tensors that view it (what autograd saved) keep their shapes and see the new memory.
void resize_storage(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == bytes) {
    return;
  }
  if (bytes == 0) {
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
  } else {
    TORCH_INTERNAL_ASSERT(storage->allocator(), "ShardedParameters: a storage without allocator");
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  }
  storage->set_nbytes(bytes);
}

size_t bytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

ShardedParameters::ShardedParameters(std::vector<at::Tensor> parameters,
                                     const ShardLayout& layout,
                                     std::vector<size_t> unit_of,
                                     GroupPtr group)
    : parameters_(std::move(parameters)),
      layout_(layout),
      unit_of_(std::move(unit_of)),
      group_(std::move(group)) {
  TORCH_INTERNAL_ASSERT(unit_of_.size() == parameters_.size());
  const size_t num_units =
      unit_of_.empty() ? 1 : *std::max_element(unit_of_.begin(), unit_of_.end()) + 1;
  units_.resize(num_units);
  next_forward_.assign(num_units, kNone);
  next_backward_.assign(num_units, kNone);
  for (const size_t u : unit_of_) {
    ++units_[u].parameters;
  }
  const int64_t rank = group_->getRank();
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const ShardBucket& bucket = layout_.buckets[b];
    const auto options = at::TensorOptions().dtype(bucket.dtype).device(bucket.device);
    at::Tensor shard = at::zeros({bucket.chunk}, options);
    const int64_t first = rank * bucket.chunk;
    size_t unit = kNone;
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const size_t i = bucket.parameters[j];
      TORCH_INTERNAL_ASSERT(unit == kNone || unit == unit_of_[i], "a bucket spans two units");
      unit = unit_of_[i];
      const at::Tensor flat = flat_view(parameters_[i]);
      const int64_t start = bucket.starts[j];
      const int64_t lo = std::max(start, first);
      const int64_t hi = std::min(start + flat.numel(), first + bucket.chunk);
      if (lo < hi) {
        shard.narrow(0, lo - first, hi - lo).copy_(flat.narrow(0, lo - start, hi - lo));
      }
    }
    shards_.push_back(shard);
    at::Tensor full = at::empty({bucket.chunk * group_->getSize()}, options);
    resize_storage(full, 0);
    full_.push_back(full);
    units_[unit].buckets.push_back(b);
  }
  for (auto& unit : units_) {
    unit.work.resize(unit.buckets.size());
  }
  for (const auto& p : parameters_) {
    shapes_.push_back(p.sizes().vec());
    empty_.push_back(at::empty({0}, p.options()));
    p.set_data(empty_.back());
  }
}

ShardedParameters::~ShardedParameters() {
  // All-gathers still running hold their tensors themselves: no wait here (see
  // ParameterShards' destructor).
}

void ShardedParameters::start_gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.state != State::kFree) {
    return;
  }
  for (size_t k = 0; k < unit.buckets.size(); ++k) {
    const size_t b = unit.buckets[k];
    resize_storage(full_[b], bytes_of(full_[b]));
    unit.work[k] = comm::start_all_gather_into(full_[b], shards_[b], group_);
  }
  unit.state = State::kGathering;
  unit.gradients = 0;
}

void ShardedParameters::finish_gather(size_t u) {
  start_gather(u);
  Unit& unit = units_[u];
  if (unit.state == State::kGathered) {
    return;
  }
  for (auto& work : unit.work) {
    auto pending = std::move(work);
    work.reset();
    comm::wait(pending, group_, "all_gather (of a unit's parameters)");
  }
  at::NoGradGuard no_grad;
  for (const size_t b : unit.buckets) {
    const ShardBucket& bucket = layout_.buckets[b];
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const size_t i = bucket.parameters[j];
      parameters_[i].set_data(full_[b]
                                  .narrow(0, bucket.starts[j], c10::multiply_integers(shapes_[i]))
                                  .view(shapes_[i]));
    }
  }
  unit.state = State::kGathered;
}

void ShardedParameters::free(size_t u) {
  Unit& unit = units_[u];
  if (unit.state == State::kFree) {
    return;
  }
  finish_gather(u);  // (a gather still running writes into the storage)
  for (const size_t b : unit.buckets) {
    for (const size_t i : layout_.buckets[b].parameters) {
      parameters_[i].set_data(empty_[i]);
    }
    resize_storage(full_[b], 0);
  }
  unit.state = State::kFree;
  unit.gradients = 0;
}

void ShardedParameters::gather_in_order(size_t u, std::vector<size_t>& next, size_t& last) {
  TORCH_CHECK(u < units_.size(), "ShardedParameters: no unit ", u);
  if (u != 0 && units_[u].buckets.empty()) {
    return;  // nothing to gather (an activation): the prefetch looks past it
  }
  if (u == 0) {
    last = kNone;  // the root: a new pass begins
  } else if (last != kNone && last != u) {
    next[last] = u;
  }
  last = u;
  finish_gather(u);
  if (next[u] != kNone) {
    start_gather(next[u]);
  }
}

void ShardedParameters::before_forward(size_t u) {
  gather_in_order(u, next_forward_, last_forward_);
}

void ShardedParameters::before_backward(size_t u) {
  gather_in_order(u, next_backward_, last_backward_);
}

void ShardedParameters::after_forward(size_t u) {
  TORCH_CHECK(u < units_.size(), "ShardedParameters: no unit ", u);
  free(u);
}

void ShardedParameters::on_gradient(size_t i) {
  Unit& unit = units_[unit_of_[i]];
  if (unit.state != State::kFree && ++unit.gradients == unit.parameters) {
    free(unit_of_[i]);
  }
}

void ShardedParameters::free_all() {
  for (size_t u = 0; u < units_.size(); ++u) {
    free(u);
  }
}

void ShardedParameters::gather_all() {
  for (size_t u = 0; u < units_.size(); ++u) {
    start_gather(u);
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    finish_gather(u);
  }
}

void ShardedParameters::write_back_and_free() {
  const int64_t rank = group_->getRank();
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].state == State::kFree) {
      continue;
    }
    finish_gather(u);
    for (const size_t b : units_[u].buckets) {
      const int64_t chunk = layout_.buckets[b].chunk;
      shards_[b].copy_(full_[b].narrow(0, rank * chunk, chunk));
    }
  }
  free_all();
}

}  // namespace torch_mp::data_parallel
