#include "torch_mp/data_parallel/data_parallel.h"

#include "torch_mp/mesh.h"
#include "torch_mp/optim/parameter_shards.h"

namespace torch_mp::data_parallel {

DataParallelImpl::DataParallelImpl(std::shared_ptr<torch::nn::Module> module_,
                                   DataParallelOptions options_)
    : module(std::move(module_)), options(std::move(options_)) {
  TORCH_CHECK(module, "DataParallel: no module");
  if (!options.group()) {
    options.group(get_mesh()->dp_cp_group);
  }
  if (const auto mesh = find_mesh(); mesh && !options.expert_group()) {
    options.expert_group(mesh->ep_group).expert_data_group(mesh->expert_dp_group);
  }
  register_module("module", module);
  const auto names = module->named_parameters().keys();
  if (options.shard_gradients() || options.grad_dtype()) {
    TORCH_CHECK(options.comm_hook() == CommHook::kNone,
                "DataParallel: shard_gradients (or grad_dtype) takes no comm_hook");
    for (const auto& p : module->parameters()) {
      TORCH_CHECK(!is_expert_parameter(p, options.expert_group()),
                  "DataParallel: shard_gradients (or grad_dtype) does not take a mixture of "
                  "experts' expert parameters yet (a parameter of shape ",
                  p.sizes(),
                  " is sharded over the expert group)");
    }
    sharded_ = ShardedGradientSync::create(module->parameters(),
                                           module->buffers(),
                                           options.group(),
                                           ShardedGradientSyncOptions()
                                               .bucket_cap_mb(options.bucket_cap_mb())
                                               .grad_dtype(options.grad_dtype())
                                               .broadcast_buffers(options.broadcast_buffers())
                                               .names(names));
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
                                         .broadcast_buffers(options.broadcast_buffers())
                                         .expert_group(options.expert_group())
                                         .expert_data_group(options.expert_data_group())
                                         .names(names));
}

void DataParallelImpl::prepare_for_forward() {
  optim::wait_for_gathers(module->parameters());  // (LibTorch has no forward pre-hooks)
  sync_ ? sync_->prepare_for_forward() : sharded_->prepare_for_forward();
}

void DataParallelImpl::zero_grad(bool set_to_none) {
  torch::nn::Module::zero_grad(set_to_none);
  if (sharded_) {
    sharded_->zero_grad();
  }
}

void DataParallelImpl::prepare_for_backward() {
  sync_ ? sync_->prepare_for_backward() : sharded_->prepare_for_backward();
}

}  // namespace torch_mp::data_parallel
