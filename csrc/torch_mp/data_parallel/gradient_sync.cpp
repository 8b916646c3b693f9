#include "torch_mp/data_parallel/gradient_sync.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "torch_mp/collectives.h"

namespace torch_mp::data_parallel {
namespace {

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

}  // namespace

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
  // Every rank starts from rank 0's parameters and buffers.
  broadcast_from_first_rank(parameters, group_);
  broadcast_from_first_rank(buffers_, group_);
  TORCH_CHECK(options.bucket_cap_mb() > 0,
              "DataParallel: bucket_cap_mb must be positive, got ",
              options.bucket_cap_mb());
  for (auto& p : parameters) {
    if (p.requires_grad()) {
      parameters_.push_back(p);
    }
  }
  comm::check_same_across_ranks({static_cast<int64_t>(parameters_.size())},
                                group_,
                                "DataParallel: the number of parameters that require grad");
  TORCH_CHECK(!parameters_.empty(), "DataParallel: the module has no parameter that requires grad");
  // Shapes, dtypes and layouts of every parameter, compared across the group (raises on all).
  c10d::verify_params_across_processes(group_, parameters_, std::nullopt);

  const auto bucket_bytes = static_cast<int64_t>(options.bucket_cap_mb() * (1 << 20));
  // As DDP does: one bucket for the first step (the order in which gradients become ready is
  // not known yet), rebuilt in that order after it.
  auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
      parameters_, {std::numeric_limits<size_t>::max()}, std::vector<bool>(parameters_.size()));
  std::reverse(buckets.begin(), buckets.end());
  std::unordered_map<size_t, std::string> names;
  reducer_ = std::make_shared<c10d::Reducer>(
      parameters_,
      std::move(buckets),
      group_,
      std::vector<bool>(parameters_.size()),
      bucket_bytes,
      /*find_unused_parameters=*/false,
      options.gradient_as_bucket_view(),
      std::move(names),
      /*first_bucket_bytes_cap=*/std::min<int64_t>(bucket_bytes, 1 << 20),
      /*skip_all_reduce_unused_params=*/false,
      /*use_python_reducer=*/false,
      /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
  switch (options.comm_hook()) {
    case CommHook::kNone:
      break;
    case CommHook::kFp16:
      reducer_->register_comm_hook(std::make_unique<CompressedAllReduce>(group_, at::kHalf));
      break;
    case CommHook::kBf16:
      reducer_->register_comm_hook(std::make_unique<CompressedAllReduce>(group_, at::kBFloat16));
      break;
  }
}

GradientSync::~GradientSync() = default;

void GradientSync::prepare_for_forward() {
  if (!at::GradMode::is_enabled()) {
    return;
  }
  reducer_->rebuild_buckets();
  if (buffers_stale_ && broadcast_buffers_ && !buffers_.empty()) {
    broadcast_from_first_rank(buffers_, group_);
  }
  buffers_stale_ = false;
}

void GradientSync::prepare_for_backward() {
  reducer_->prepare_for_backward({});
  buffers_stale_ = true;
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
