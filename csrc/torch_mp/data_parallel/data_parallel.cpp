#include "torch_mp/data_parallel/data_parallel.h"

#include "torch_mp/mesh.h"

namespace torch_mp::data_parallel {

DataParallelImpl::DataParallelImpl(std::shared_ptr<torch::nn::Module> module_,
                                   DataParallelOptions options_)
    : module(std::move(module_)), options(std::move(options_)) {
  TORCH_CHECK(module, "DataParallel: no module");
  if (!options.group()) {
    options.group(get_mesh()->dp_cp_group);
  }
  register_module("module", module);
  if (options.shard_gradients() || options.grad_dtype()) {
    TORCH_CHECK(options.comm_hook() == CommHook::kNone && !options.gradient_as_bucket_view(),
                "DataParallel: shard_gradients (or grad_dtype) takes no comm_hook and no "
                "gradient_as_bucket_view");
    sharded_ = ShardedGradientSync::create(module->parameters(),
                                           module->buffers(),
                                           options.group(),
                                           ShardedGradientSyncOptions()
                                               .bucket_cap_mb(options.bucket_cap_mb())
                                               .grad_dtype(options.grad_dtype())
                                               .broadcast_buffers(options.broadcast_buffers()));
    return;
  }
  sync_ =
      std::make_unique<GradientSync>(module->parameters(),
                                     module->buffers(),
                                     options.group(),
                                     GradientSyncOptions()
                                         .bucket_cap_mb(options.bucket_cap_mb())
                                         .gradient_as_bucket_view(options.gradient_as_bucket_view())
                                         .comm_hook(options.comm_hook())
                                         .broadcast_buffers(options.broadcast_buffers()));
}

void DataParallelImpl::prepare_for_forward() {
  sync_ ? sync_->prepare_for_forward() : sharded_->prepare_for_forward();
}

void DataParallelImpl::prepare_for_backward() {
  sync_ ? sync_->prepare_for_backward() : sharded_->prepare_for_backward();
}

}  // namespace torch_mp::data_parallel
