#include "torch_mp/data_parallel/data_parallel.h"

#include "torch_mp/mesh.h"

namespace torch_mp::data_parallel {

DataParallelImpl::DataParallelImpl(std::shared_ptr<torch::nn::Module> module_,
                                   DataParallelOptions options_)
    : module(std::move(module_)), options(std::move(options_)) {
  TORCH_CHECK(module, "DataParallel: no module");
  if (!options.group()) {
    options.group(get_mesh()->dp_group);
  }
  register_module("module", module);
  // Every rank starts from rank 0's parameters and buffers.
  broadcast_from_first_rank(module->parameters(), options.group());
  broadcast_from_first_rank(module->buffers(), options.group());
  sync_ =
      std::make_unique<GradientSync>(module->parameters(),
                                     options.group(),
                                     GradientSyncOptions()
                                         .bucket_cap_mb(options.bucket_cap_mb())
                                         .gradient_as_bucket_view(options.gradient_as_bucket_view())
                                         .comm_hook(options.comm_hook()));
}

void DataParallelImpl::prepare_for_forward() {
  if (!at::GradMode::is_enabled()) {
    return;
  }
  sync_->prepare_for_forward();
  if (buffers_stale_ && options.broadcast_buffers() && !module->buffers().empty()) {
    broadcast_from_first_rank(module->buffers(), options.group());
  }
  buffers_stale_ = false;
}

void DataParallelImpl::prepare_for_backward() {
  sync_->prepare_for_backward();
  buffers_stale_ = true;
}

}  // namespace torch_mp::data_parallel
