#include "torch_mp/data_parallel/gradient_sync.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <unordered_map>

#include "torch_mp/collectives.h"
#include "torch_mp/data_parallel/gradient_hooks.h"
#include "torch_mp/data_parallel/owners.h"
#include "torch_mp/data_parallel/sharded_state.h"
#include "torch_mp/layout.h"

namespace torch_mp::data_parallel {
namespace {

// Which GradientSync reduces each parameter's gradient (a step looks it up).

constexpr size_t kBroadcastBucketBytes = 250u << 20;  // DDP's broadcast bucket

// All-reduces a bucket in 16 bits: compress (dividing by the group size first, so the sum
// cannot overflow), all-reduce, decompress into the bucket.
class CompressedAllReduce : public c10d::CppCommHookInterface<GroupPtr> {
 public:
  CompressedAllReduce(GroupPtr group, at::ScalarType dtype)
      : c10d::CppCommHookInterface<GroupPtr>(std::move(group)), dtype_(dtype) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    std::vector<at::Tensor> compressed{buffer.to(dtype_).div_(state_->getSize())};
    auto reduced = state_->allreduce(compressed)->getFuture();
    return reduced->then(
        [buffer, compressed](c10::ivalue::Future&) {
          buffer.copy_(compressed[0]);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }

 private:
  at::ScalarType dtype_;
};

// All-reduces a bucket and divides it by `divisor` (the whole data group's size, for the experts'
// gradients reduced over the expert-data group).
class DividedAllReduce : public c10d::CppCommHookInterface<GroupPtr> {
 public:
  DividedAllReduce(GroupPtr group, int64_t divisor)
      : c10d::CppCommHookInterface<GroupPtr>(std::move(group)), divisor_(divisor) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    std::vector<at::Tensor> tensors{buffer};
    auto reduced = state_->allreduce(tensors)->getFuture();
    const auto divisor = divisor_;
    return reduced->then(
        [buffer, divisor](c10::ivalue::Future&) {
          buffer.div_(divisor);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }

 private:
  int64_t divisor_;
};

std::shared_ptr<c10d::Reducer> make_reducer(const std::vector<at::Tensor>& parameters,
                                            const GroupPtr& group,
                                            const GradientSyncOptions& options) {
  const auto bucket_bytes = static_cast<int64_t>(options.bucket_cap_mb() * (1 << 20));
  // As DDP does: one bucket for the first step (the order in which gradients become ready is
  // not known yet), rebuilt in that order after it.
  auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
      parameters, {std::numeric_limits<size_t>::max()}, std::vector<bool>(parameters.size()));
  std::reverse(buckets.begin(), buckets.end());
  std::unordered_map<size_t, std::string> names;
  return std::make_shared<c10d::Reducer>(
      parameters,
      std::move(buckets),
      group,
      std::vector<bool>(parameters.size()),
      bucket_bytes,
      /*find_unused_parameters=*/false,
      options.gradient_as_bucket_view(),
      std::move(names),
      /*first_bucket_bytes_cap=*/std::min<int64_t>(bucket_bytes, 1 << 20),
      /*skip_all_reduce_unused_params=*/false,
      /*use_python_reducer=*/false,
      /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
}

}  // namespace

bool is_expert_parameter(const at::Tensor& parameter, const GroupPtr& expert_group) {
  if (!expert_group || expert_group->getSize() == 1) {
    return false;
  }
  const auto layout = layout_of(parameter);
  return layout && layout->shard_dim && layout->group == expert_group;
}

CommHook parse_comm_hook(const std::string& name) {
  if (name == "none" || name.empty()) {
    return CommHook::kNone;
  }
  if (name == "fp16") {
    return CommHook::kFp16;
  }
  if (name == "bf16") {
    return CommHook::kBf16;
  }
  TORCH_CHECK(
      false, "DataParallel: comm_hook must be None, \"fp16\" or \"bf16\", got \"", name, "\"");
}

GradientSync::GradientSync(std::vector<at::Tensor> parameters,
                           std::vector<at::Tensor> buffers,
                           GroupPtr group,
                           GradientSyncOptions options)
    : buffers_(std::move(buffers)),
      group_(std::move(group)),
      broadcast_buffers_(options.broadcast_buffers()) {
  TORCH_CHECK(group_, "DataParallel: no data-parallel group");
  TORCH_CHECK(options.bucket_cap_mb() > 0,
              "DataParallel: bucket_cap_mb must be positive, got ",
              options.bucket_cap_mb());
  const auto names = names_requiring_grad(parameters, options.names(), "DataParallel");
  std::vector<at::Tensor> experts;  // the experts' parameters, reduced over their own group
  std::vector<at::Tensor> shared;   // the others
  std::vector<std::string> expert_names, shared_names;
  for (size_t i = 0, named = 0; i < parameters.size(); ++i) {
    const bool expert = is_expert_parameter(parameters[i], options.expert_group());
    (expert ? experts : shared).push_back(parameters[i]);
    if (!names.empty() && parameters[i].requires_grad()) {
      (expert ? expert_names : shared_names).push_back(names[named++]);
    }
  }
  const auto& expert_data = options.expert_data_group();
  TORCH_CHECK(experts.empty() || expert_data,
              "DataParallel: expert parameters (sharded over the expert group) need an "
              "expert_data_group to reduce over");
  // Every rank starts from rank 0's parameters and buffers (the experts from that of the ranks
  // holding the same experts).
  broadcast_from_first_rank(shared, group_);
  broadcast_from_first_rank(buffers_, group_);
  if (expert_data) {
    comm::check_same_across_ranks({static_cast<int64_t>(experts.size())},
                                  group_,
                                  "DataParallel: the number of expert parameters");
    broadcast_from_first_rank(experts, expert_data);
  }
  const auto requiring_grad = [](const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> out;
    for (const auto& t : tensors) {
      if (t.requires_grad()) {
        out.push_back(t);
      }
    }
    return out;
  };
  shared = requiring_grad(shared);
  experts = requiring_grad(experts);
  parameters_ = shared;
  parameters_.insert(parameters_.end(), experts.begin(), experts.end());
  shared_names.insert(shared_names.end(), expert_names.begin(), expert_names.end());
  comm::check_same_across_ranks({static_cast<int64_t>(parameters_.size())},
                                group_,
                                "DataParallel: the number of parameters that require grad");
  TORCH_CHECK(!parameters_.empty(), "DataParallel: the module has no parameter that requires grad");
  // Shapes, dtypes and layouts of every parameter, compared across the group (raises on all).
  c10d::verify_params_across_processes(group_, parameters_, std::nullopt);

  if (!shared.empty()) {
    auto reducer = make_reducer(shared, group_, options);
    switch (options.comm_hook()) {
      case CommHook::kNone:
        break;
      case CommHook::kFp16:
        reducer->register_comm_hook(std::make_unique<CompressedAllReduce>(group_, at::kHalf));
        break;
      case CommHook::kBf16:
        reducer->register_comm_hook(std::make_unique<CompressedAllReduce>(group_, at::kBFloat16));
        break;
    }
    reducers_.push_back(std::move(reducer));
  }
  if (!experts.empty()) {
    TORCH_CHECK(options.comm_hook() == CommHook::kNone,
                "DataParallel: a comm_hook does not take expert parameters yet");
    auto reducer = make_reducer(experts, expert_data, options);
    reducer->register_comm_hook(std::make_unique<DividedAllReduce>(expert_data, group_->getSize()));
    reducers_.push_back(std::move(reducer));
  }
  armed_ = std::make_unique<ArmedBackward>(parameters_, shared_names);
  hooks_ = std::make_unique<GradientHooks>(parameters_, [this](size_t i) {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_->mark(i);
  });
  change_owners(parameters_, [this](size_t, Owners& owner) { owner.sync = this; });
}

GradientSync::~GradientSync() {
  hooks_.reset();
  change_owners(parameters_, [this](size_t, Owners& owner) {
    if (owner.sync == this) {
      owner.sync = nullptr;
    }
  });
}

GradientSync* GradientSync::of(const at::Tensor& parameter) {
  return owners_of({parameter}).front().sync;
}

void GradientSync::check_complete() const {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_->check_complete("DataParallel");
}

void GradientSync::prepare_for_forward() {
  if (!at::GradMode::is_enabled()) {
    return;
  }
  check_complete();  // (before the reducer raises its own message, which names no parameter)
  for (const auto& reducer : reducers_) {
    reducer->rebuild_buckets();
  }
  if (buffers_stale_ && broadcast_buffers_ && !buffers_.empty()) {
    broadcast_from_first_rank(buffers_, group_);
  }
  buffers_stale_ = false;
}

void GradientSync::prepare_for_backward() {
  check_complete();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_->arm();
  }
  for (const auto& reducer : reducers_) {
    reducer->prepare_for_backward({});
  }
  buffers_stale_ = true;
}

void check_reductions_complete(const std::vector<at::Tensor>& parameters) {
  std::vector<const GradientSync*> plain;
  std::vector<std::shared_ptr<ShardedState>> sharded;
  for (const auto& p : parameters) {
    if (const auto* engine = GradientSync::of(p)) {
      if (std::find(plain.begin(), plain.end(), engine) == plain.end()) {
        plain.push_back(engine);
        engine->check_complete();
      }
    } else if (auto engine = ShardedState::of(p)) {
      if (std::find(sharded.begin(), sharded.end(), engine) == sharded.end()) {
        sharded.push_back(engine);
        engine->check_complete();
      }
    }
  }
}

void broadcast_from_first_rank(const std::vector<at::Tensor>& tensors, const GroupPtr& group) {
  comm::check_same_tensors_across_ranks(tensors, group, "DataParallel: the tensors to broadcast");
  if (tensors.empty() || group->getSize() == 1) {
    return;
  }
  std::vector<at::Tensor> data;
  for (const auto& t : tensors) {
    data.push_back(t.detach());
  }
  c10d::broadcast_coalesced(group, data, kBroadcastBucketBytes, 0);
}

}  // namespace torch_mp::data_parallel
