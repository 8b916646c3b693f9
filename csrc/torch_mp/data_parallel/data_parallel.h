#pragma once
// torch_mp::DataParallel: data parallelism for LibTorch applications (PyTorch's DDP exists only
// in Python), over the same engine as torch_mp.DataParallel (GradientSync, i.e. c10d::Reducer).
//
//   auto model = Net(...);
//   torch_mp::DataParallel dp(model);            // broadcasts rank 0's parameters and buffers
//   auto loss = loss_fn(dp->forward(x), y);      // (each rank its own shard of the batch)
//   loss.backward();                             // gradients averaged over the data group,
//   optimizer.step();                            // bucket by bucket, overlapped with backward
//
// Gradient accumulation: backwards run inside `auto guard = dp->no_sync();` accumulate locally;
// the next synced backward reduces the sum.
//
// Every parameter must get a gradient in a synced backward: the next forward raises, naming
// those that did not (a torch_mp::DistributedOptimizer already at its step; LibTorch's own
// optimizers have no step hook through which to refuse).

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include "torch_mp/data_parallel/gradient_sync.h"
#include "torch_mp/data_parallel/sharded_state.h"

namespace torch_mp::data_parallel {

/// Options of DataParallel.
struct DataParallelOptions {
  /// The data-parallel group; the default mesh's dp_cp_group (its data group, times the
  /// context group when cp > 1: parameters are replicated over both) when null.
  TORCH_ARG(GroupPtr, group) = {};
  /// Size of a gradient bucket in MiB.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Make each `.grad` a view into its bucket instead of copying (one copy of the gradients,
  /// not two). Off by default, unlike Python's: LibTorch's optimizers detach_() the gradients
  /// in zero_grad, which views refuse. Not used by shard_gradients, which has no such buckets.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before each synced step's
  /// first forward, as DDP does.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Gradient compression for the all-reduce (none, fp16, bf16).
  TORCH_ARG(CommHook, comm_hook) = CommHook::kNone;
  /// Reduce-scatter the gradients so that each rank keeps its range's only (ZeRO-2), for a
  /// DistributedOptimizer over the module's parameters (sharded_state.h): the
  /// parameters' .grad are then empty after a synced backward. A plain torch::optim optimizer
  /// would find no gradient and change nothing: LibTorch has no step hook through which to
  /// refuse it, so the next synced forward raises instead.
  TORCH_ARG(bool, shard_gradients) = false;
  /// Accumulate every backward's gradients into main gradients of this dtype (fp32 for 16-bit
  /// parameters) and reduce in it; implies shard_gradients (the DistributedOptimizer reads them).
  TORCH_ARG(std::optional<at::ScalarType>, grad_dtype) = std::nullopt;
  /// Shard the parameters too (ZeRO-3; implies shard_gradients: sharded_parameters.h): between
  /// steps each rank holds only its range of them, and a parameter's data is an empty tensor
  /// (read whole parameters inside gathered_parameters(), or through torch_mp::checkpoint).
  /// LibTorch modules have no forward hooks, so the forward gathers every unit before it
  /// starts and frees them when it ends; the backward gathers them again as it starts and
  /// frees each unit once its gradients are reduce-scattered. Step with a
  /// torch_mp::DistributedOptimizer over module->parameters().
  TORCH_ARG(bool, shard_parameters) = false;
  /// Under shard_parameters, the module types whose instances are units, by name: "Block"
  /// names BlockImpl in any namespace (Module::name()); empty: each child of the module
  /// (a ModuleList's or ModuleDict's members). The module itself is a unit too, holding the
  /// parameters outside every other; a parameter shared by units belongs to the innermost unit
  /// that holds them all.
  TORCH_ARG(std::vector<std::string>, units) = {};
  /// Expert parallelism: the experts' parameters (sharded over `expert_group`) reduced over
  /// `expert_data_group` instead (GradientSyncOptions::expert_group); the default mesh's
  /// ep_group and expert_dp_group when unset and there is a default mesh.
  TORCH_ARG(GroupPtr, expert_group) = {};
  TORCH_ARG(GroupPtr, expert_data_group) = {};
};

/// Wraps a module so that its gradients are averaged over the data-parallel group.
class DataParallelImpl : public torch::nn::Module {
 public:
  /// Wraps a module holder whose forward is not a template (e.g. torch::nn::Linear or a
  /// TORCH_MODULE of your own); `forward` then calls it.
  template <typename ModuleType>
  explicit DataParallelImpl(torch::nn::ModuleHolder<ModuleType> module,
                            DataParallelOptions options = {})
      : DataParallelImpl(module.ptr(), std::move(options)) {
    forward_ = torch::nn::AnyModule(module);
  }
  /// Wraps any module (a Sequential too); call `prepare_for_forward` and `prepare_for_backward`
  /// around its forward yourself, or use it as a pipeline stage.
  DataParallelImpl(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options = {});

  /// Runs the wrapped module's forward as DDP does: buffers broadcast when due, and the
  /// reduction armed for the backward that follows unless under no_sync.
  template <typename... Args>
  at::Tensor forward(Args&&... args) {
    TORCH_CHECK(!forward_.is_empty(),
                "DataParallel: the wrapped module was given as a plain Module; call it directly, "
                "between prepare_for_forward() and prepare_for_backward()");
    prepare_for_forward();
    at::Tensor output = forward_.forward(std::forward<Args>(args)...);
    finish_forward({output});
    if (require_backward_grad_sync_ && at::GradMode::is_enabled()) {
      prepare_for_backward();
    }
    return output;
  }

  /// Before a forward: waits for a DistributedOptimizer's overlapped all-gather of these
  /// parameters, rebuilds the buckets once, and broadcasts buffers when due; with
  /// shard_parameters, gathers every unit.
  void prepare_for_forward();
  /// After a forward, with shard_parameters: frees every unit, and makes the backward through
  /// `outputs` gather them again (forward does it; call it yourself after calling the wrapped
  /// module directly). Without: nothing.
  void finish_forward(const std::vector<at::Tensor>& outputs);
  /// Every parameter whole until the returned guard ends (collective over the data group);
  /// with `write_back`, what was written into them is kept. Without shard_parameters the
  /// parameters are always whole, and the guard does nothing.
  [[nodiscard]] WholeParameters gathered_parameters(bool write_back = false) {
    return WholeParameters(module->parameters(), write_back);
  }
  /// The sharded state this DataParallel made (shard_gradients, grad_dtype or
  /// shard_parameters; null otherwise): what to hand its DistributedOptimizer
  /// (DistributedOptimizerOptions::sharded_state).
  const std::shared_ptr<ShardedState>& sharded_state() const { return sharded_; }
  /// Arms the reduction for the next backward (forward does this unless under no_sync).
  /// Raises, naming them, if the last synced backward gave some parameters no gradient.
  void prepare_for_backward();
  /// Zeros (or drops) the gradients, as any module's zero_grad, and with shard_gradients or
  /// grad_dtype also the reduced and main gradients held for them: a backward dropped this way
  /// adds nothing to the next step. (The wrapped module's own zero_grad cannot reach those.)
  void zero_grad(bool set_to_none = true) override;

  /// While the returned guard lives, forward does not arm the reduction: backwards accumulate
  /// gradients locally, to be reduced by the next synced backward.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DataParallelImpl& owner)
        : owner_(owner), previous_(owner.require_backward_grad_sync_) {
      owner_.require_backward_grad_sync_ = false;
    }
    ~NoSyncGuard() { owner_.require_backward_grad_sync_ = previous_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DataParallelImpl& owner_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// The wrapped module.
  std::shared_ptr<torch::nn::Module> module;
  DataParallelOptions options;

 private:
  torch::nn::AnyModule forward_;
  std::unique_ptr<GradientSync> sync_;     // all-reduce, or
  std::shared_ptr<ShardedState> sharded_;  // reduce-scatter
  bool require_backward_grad_sync_ = true;
};

/// Holder of DataParallelImpl.
TORCH_MODULE(DataParallel);

}  // namespace torch_mp::data_parallel

namespace torch_mp {
using data_parallel::CommHook;
using data_parallel::DataParallel;
using data_parallel::DataParallelImpl;
using data_parallel::DataParallelOptions;
}  // namespace torch_mp
