#include "torch_mp/data_parallel/sharded_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <sstream>
#include <unordered_map>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"
#include "torch_mp/data_parallel/gradient_hooks.h"
#include "torch_mp/data_parallel/gradient_sync.h"
#include "torch_mp/data_parallel/owners.h"
#include "torch_mp/data_parallel/sharded_parameters.h"

namespace torch_mp::data_parallel {
namespace {

// Which engine reduces each parameter's gradient (the optimizer and clipping look it up).

// Whether Gloo carries the group's collectives on `device`.
bool gloo_serves(const GroupPtr& group, const c10::Device& device) {
  if (!device.is_cpu()) {
    return false;
  }
  try {
    return group->getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
  } catch (const c10::Error&) {  // no CPU backend: the collective itself will say so
    return false;
  }
}

}  // namespace

std::shared_ptr<ShardedState> ShardedState::create(std::vector<at::Tensor> parameters,
                                                   std::vector<at::Tensor> buffers,
                                                   GroupPtr group,
                                                   ShardedStateOptions options) {
  std::shared_ptr<ShardedState> sync(new ShardedState(
      std::move(parameters), std::move(buffers), std::move(group), std::move(options)));
  sync->register_hooks();  // (their gradient accumulators take the parameters' whole shapes)
  if (options.shard_parameters()) {
    sync->sharded_ = std::make_unique<ShardedParameters>(
        sync->parameters_, sync->layout_, sync->units_, sync->group_);
  }
  return sync;
}

ShardedState::ShardedState(std::vector<at::Tensor> parameters,
                           std::vector<at::Tensor> buffers,
                           GroupPtr group,
                           ShardedStateOptions options)
    : buffers_(std::move(buffers)),
      group_(std::move(group)),
      broadcast_buffers_(options.broadcast_buffers()),
      bucket_cap_mb_(options.bucket_cap_mb()),
      grad_dtype_(options.grad_dtype()) {
  TORCH_CHECK(group_, "DataParallel: no data-parallel group");
  broadcast_from_first_rank(parameters, group_);
  broadcast_from_first_rank(buffers_, group_);
  auto names = names_requiring_grad(parameters, options.names(), "DataParallel");
  const auto& units = options.units();
  TORCH_CHECK(!options.shard_parameters() || units.size() == parameters.size(),
              "DataParallel(shard_parameters=True): ",
              units.size(),
              " units for ",
              parameters.size(),
              " parameters");
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (parameters[i].requires_grad()) {
      parameters_.push_back(parameters[i]);
      if (options.shard_parameters()) {
        units_.push_back(units[i]);
      }
    }
  }
  armed_ = std::make_unique<ArmedBackward>(parameters_, names);
  comm::check_same_tensors_across_ranks(
      parameters_, group_, "DataParallel: the parameters that require grad");
  TORCH_CHECK(!parameters_.empty(), "DataParallel: the module has no parameter that requires grad");
  layout_ = ShardLayout::of(
      parameters_, group_->getSize(), group_->getRank(), bucket_cap_mb_, "DataParallel", units_);
  for (const auto& bucket : layout_.buckets) {
    all_reduced_.push_back(gloo_serves(group_, bucket.device));
  }
  bucket_of_.resize(parameters_.size());
  start_of_.resize(parameters_.size());
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& members = layout_.buckets[b].parameters;
    for (size_t j = 0; j < members.size(); ++j) {
      bucket_of_[members[j]] = b;
      start_of_[members[j]] = layout_.buckets[b].starts[j];
    }
    if (grad_dtype_) {
      const auto& bucket = layout_.buckets[b];
      main_.push_back(at::zeros({bucket.chunk * group_->getSize()},
                                at::TensorOptions().dtype(*grad_dtype_).device(bucket.device)));
    }
  }
  piece_bucket_.resize(layout_.pieces.size());
  piece_start_.resize(layout_.pieces.size());
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& bucket = layout_.buckets[b];
    for (size_t k = 0; k < bucket.pieces.size(); ++k) {
      piece_bucket_[bucket.pieces[k]] = b;
      piece_start_[bucket.pieces[k]] = bucket.piece_starts[k];
    }
  }
  reduced_.resize(layout_.buckets.size());
  shard_.resize(layout_.buckets.size());
  ready_count_.assign(layout_.buckets.size(), 0);
}

void ShardedState::register_hooks() {
  std::weak_ptr<ShardedState> weak = weak_from_this();
  change_owners(parameters_, [this, &weak](size_t i, Owners& owner) {
    TORCH_CHECK(owner.sharded.expired(),
                "DataParallel: ",
                name(i),
                " is already wrapped in another DataParallel that shards its gradients");
    owner.sharded = weak;
  });
  hooks_ = std::make_unique<GradientHooks>(parameters_, [weak](size_t i) {
    if (auto self = weak.lock()) {
      self->on_gradient(i);
    }
  });
}

ShardedState::~ShardedState() {
  hooks_.reset();
  change_owners(parameters_, [](size_t, Owners& owner) {
    if (owner.sharded.expired()) {
      owner.sharded.reset();
    }
  });
}

std::string ShardedState::name(size_t i) const { return armed_->name(i); }

std::shared_ptr<ShardedState> ShardedState::of(const at::Tensor& parameter) {
  return owners_of({parameter}).front().sharded.lock();
}

void ShardedState::prepare_for_forward() {
  if (!at::GradMode::is_enabled()) {
    return;
  }
  if (buffers_stale_ && broadcast_buffers_ && !buffers_.empty()) {
    broadcast_from_first_rank(buffers_, group_);
  }
  buffers_stale_ = false;
}

void ShardedState::prepare_for_backward() {
  check_complete();
  std::lock_guard<std::mutex> lock(mutex_);
  // Reduced gradients that no DistributedOptimizer stepped (or zero_grad dropped): a plain
  // optimizer stepped these parameters without finding them, and changed nothing.
  for (const auto& reduced : reduced_) {
    TORCH_CHECK(!reduced.defined(),
                "DataParallel(shard_gradients=True): the gradients the last synced backward "
                "reduced were not stepped by a torch_mp::DistributedOptimizer (a plain optimizer "
                "finds no .grad here and changes nothing); accumulate over micro-batches under "
                "no_sync()");
  }
  buffers_stale_ = true;
  armed_->arm();
  ready_count_.assign(layout_.buckets.size(), 0);
  launched_ = 0;
}

void ShardedState::on_gradient(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (sharded_) {  // (the unit may be freed: its gradient is in .grad)
    sharded_->on_gradient(i);
  }
  at::Tensor& grad = parameters_[i].mutable_grad();
  if (!grad.defined()) {
    return;
  }
  const size_t b = bucket_of_[i];
  if (grad_dtype_) {  // into the main gradients, this backward's part
    TORCH_CHECK(!reduced_[b].defined(),
                "DataParallel(grad_dtype=...): a backward ran while the main gradients hold the "
                "last synced backward's reduced gradients, which no step has taken yet; step "
                "the DistributedOptimizer (or zero_grad) before the next backward");
    main_[b].narrow(0, start_of_[i], grad.numel()).add_(flat_view(grad));
    main_dirty_ = true;
    grad.reset();
  }
  if (!armed_->mark(i)) {
    return;
  }
  if (++ready_count_[b] == layout_.buckets[b].parameters.size()) {
    launch(b);
  }
}

void ShardedState::launch(size_t b) {
  const ShardBucket& bucket = layout_.buckets[b];
  const int64_t size = group_->getSize();
  const int64_t chunk = bucket.chunk;
  const auto options = at::TensorOptions().dtype(bucket.dtype).device(bucket.device);
  at::Tensor input;
  int staging = -1;
  if (grad_dtype_) {
    input = main_[b];
  } else {
    // (ZeRO-3 keeps one staging buffer: its memory bound is the formula plus one unit)
    const size_t slots = sharded_ ? 1 : staging_.size();
    staging = static_cast<int>(next_staging_++ % slots);
    input = staging_buffer(staging, chunk * size, options);
    int64_t used = 0;
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      at::Tensor& grad = parameters_[bucket.parameters[j]].mutable_grad();
      input.narrow(0, bucket.starts[j], grad.numel()).copy_(flat_view(grad));
      used = bucket.starts[j] + grad.numel();
      grad.reset();
    }
    input.narrow(0, used, chunk * size - used).zero_();  // the padding
  }
  input.div_(size);  // averaged, as DDP divides before it sums
  // This rank's range of the sum: with grad_dtype, in place in the main gradients (no buffer of
  // its own); else into a shard buffer kept from step to step.
  at::Tensor output;
  if (grad_dtype_) {
    output = input.narrow(0, group_->getRank() * chunk, chunk);
  } else {
    if (!shard_[b].defined()) {
      shard_[b] = at::empty({chunk}, options);
    }
    output = shard_[b];
  }
  // Gloo's reduce_scatter is slower than its all_reduce of the whole bucket (28 against 22 ms
  // for 25 MB at 2 ranks, benchmarks/collectives.py), so on Gloo the bucket is all-reduced and
  // this rank's range kept: the same sums, in the memory already held.
  if (all_reduced_[b]) {
    std::vector<at::Tensor> whole{input};
    at::Tensor summed =
        grad_dtype_ ? at::Tensor() : input.narrow(0, group_->getRank() * chunk, chunk);
    pending_.push_back({b, staging, output, group_->allreduce(whole), summed});
  } else {
    std::vector<at::Tensor> outputs{output};
    std::vector<std::vector<at::Tensor>> inputs(1);
    for (int64_t r = 0; r < size; ++r) {
      inputs[0].push_back(input.narrow(0, r * chunk, chunk));
    }
    pending_.push_back({b, staging, output, group_->reduce_scatter(outputs, inputs), {}});
  }
  if (++launched_ == layout_.buckets.size()) {
    finish();
  }
}

ShardedBytes ShardedState::bytes() const {
  const auto held = [](const std::vector<at::Tensor>& tensors) {
    int64_t total = 0;
    for (const auto& t : tensors) {
      total += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    }
    return total;
  };
  std::lock_guard<std::mutex> lock(mutex_);
  ShardedBytes bytes;
  bytes.main_gradients = held(main_);
  bytes.reduced_gradients = held(shard_);
  bytes.staging = held({staging_.begin(), staging_.end()});
  if (sharded_) {
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      bytes.parameter_shards += static_cast<int64_t>(sharded_->shard(b).nbytes());
    }
  }
  return bytes;
}

at::Tensor ShardedState::staging_buffer(int slot, int64_t numel, const at::TensorOptions& options) {
  for (auto& pending : pending_) {
    if (pending.staging == slot) {
      complete(pending);  // its bucket still reads the buffer
    }
  }
  at::Tensor& buffer = staging_[slot];
  if (!buffer.defined() || buffer.numel() < numel || buffer.dtype() != options.dtype() ||
      buffer.device() != options.device()) {
    buffer = at::empty({numel}, options);
  }
  return buffer.narrow(0, 0, numel);
}

void ShardedState::complete(Pending& pending) {
  if (!pending.work) {
    return;
  }
  comm::wait(pending.work, group_, all_reduced_[pending.bucket] ? "all_reduce" : "reduce_scatter");
  pending.work.reset();
  if (pending.summed.defined()) {
    pending.output.copy_(pending.summed);
    pending.summed.reset();
  }
  pending.staging = -1;
  // (prepare_for_backward refused to arm while reduced gradients were held)
  TORCH_INTERNAL_ASSERT(!reduced_[pending.bucket].defined());
  reduced_[pending.bucket] = pending.output;
  if (grad_dtype_) {  // sent: the other ranks' ranges start the next step afresh
    const int64_t chunk = layout_.buckets[pending.bucket].chunk;
    const int64_t rank = group_->getRank();
    at::Tensor& main = main_[pending.bucket];
    main.narrow(0, 0, rank * chunk).zero_();
    main.narrow(0, (rank + 1) * chunk, main.numel() - (rank + 1) * chunk).zero_();
  }
}

void ShardedState::finish() {
  for (auto& pending : pending_) {
    complete(pending);
  }
  pending_.clear();
  main_dirty_ = false;
}

at::Tensor ShardedState::piece_gradient(size_t piece) const {
  check_complete();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(piece < piece_bucket_.size(), "ShardedState: no piece ", piece);
  const at::Tensor& reduced = reduced_[piece_bucket_[piece]];
  return reduced.defined() ? reduced.narrow(0, piece_start_[piece], layout_.pieces[piece].numel)
                           : at::Tensor();
}

void ShardedState::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& r : reduced_) {
    if (r.defined() && grad_dtype_) {
      r.zero_();  // (this rank's range of the main gradients, where the next step accumulates)
    }
    r.reset();
  }
}

void ShardedState::zero_grad() {
  release();
  std::lock_guard<std::mutex> lock(mutex_);
  if (main_dirty_) {
    for (auto& main : main_) {
      main.zero_();
    }
    main_dirty_ = false;
  }
}

void ShardedState::check_complete() const {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_->check_complete("DataParallel(shard_gradients=True)");
}

// ---- ZeRO-3 ----

namespace {
void check_sharding(const std::unique_ptr<ShardedParameters>& sharded) {
  TORCH_CHECK(sharded, "DataParallel: the parameters are not sharded (shard_parameters=False)");
}
}  // namespace

void ShardedState::before_forward(size_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_sharding(sharded_);
  sharded_->before_forward(unit);
}

void ShardedState::after_forward(size_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_sharding(sharded_);
  sharded_->after_forward(unit);
}

void ShardedState::before_backward(size_t unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_sharding(sharded_);
  sharded_->before_backward(unit);
}

void ShardedState::gather_parameters() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_sharding(sharded_);
  sharded_->gather_all();
}

void ShardedState::free_parameters() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_sharding(sharded_);
  sharded_->free_all();
}

void ShardedState::write_back_parameters() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_sharding(sharded_);
  sharded_->write_back_and_free();
}

size_t ShardedState::num_units() const { return sharded_ ? sharded_->num_units() : 0; }

WholeParameters::WholeParameters(const std::vector<at::Tensor>& parameters, bool write_back)
    : write_back_(write_back) {
  for (const auto& p : parameters) {
    auto engine = ShardedState::of(p);
    if (engine && engine->shards_parameters() &&
        std::find(engines_.begin(), engines_.end(), engine) == engines_.end()) {
      engines_.push_back(std::move(engine));
    }
  }
  for (const auto& engine : engines_) {
    engine->gather_parameters();
  }
}

void WholeParameters::release() {
  auto engines = std::move(engines_);
  engines_.clear();
  for (const auto& engine : engines) {
    write_back_ ? engine->write_back_parameters() : engine->free_parameters();
  }
}

WholeParameters::~WholeParameters() noexcept(false) {
  if (std::uncaught_exceptions() > 0) {  // (unwinding: a second exception would terminate)
    try {
      release();
    } catch (...) {
    }
    return;
  }
  release();
}

std::vector<int64_t> ShardedState::parameter_shape(size_t i) const {
  TORCH_CHECK(i < parameters_.size(), "ShardedState: no parameter ", i);
  return sharded_ ? sharded_->shape(i) : parameters_[i].sizes().vec();
}

at::Tensor ShardedState::parameter_piece(size_t piece) const {
  check_sharding(sharded_);
  TORCH_CHECK(piece < piece_bucket_.size(), "ShardedState: no piece ", piece);
  return sharded_->shard(piece_bucket_[piece])
      .narrow(0, piece_start_[piece], layout_.pieces[piece].numel);
}

}  // namespace torch_mp::data_parallel
