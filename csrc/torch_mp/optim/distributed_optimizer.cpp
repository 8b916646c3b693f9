#include "torch_mp/optim/distributed_optimizer.h"

#include "torch_mp/mesh.h"

namespace torch_mp::optim {

void DistributedOptimizer::build(const DistributedOptimizerOptions& options,
                                 const MakeLocal& make_local) {
  GroupPtr group = options.group() ? options.group() : get_mesh()->dp_cp_group;
  const auto mesh = find_mesh();
  std::vector<at::Tensor> parameters;
  std::vector<size_t> group_of;  // each parameter's param group
  for (size_t g = 0; g < param_groups().size(); ++g) {
    for (const auto& p : param_groups()[g].params()) {
      parameters.push_back(p);
      group_of.push_back(g);
    }
  }
  shards_ =
      std::make_unique<ParameterShards>(std::move(parameters),
                                        std::move(group),
                                        ParameterShardsOptions()
                                            .bucket_cap_mb(options.bucket_cap_mb())
                                            .master_dtype(options.master_dtype())
                                            .overlap_param_gather(options.overlap_param_gather())
                                            .sharded_state(options.sharded_state())
                                            .expert_group(mesh ? mesh->ep_group : nullptr));
  std::vector<std::vector<at::Tensor>> local_params(param_groups().size());
  for (size_t s = 0; s < shards_->pieces().size(); ++s) {
    local_params[group_of[shards_->pieces()[s].parameter]].push_back(shards_->shards()[s]);
  }
  std::vector<torch::optim::OptimizerParamGroup> local_groups;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    local_groups.emplace_back(std::move(local_params[g]), param_groups()[g].options().clone());
  }
  local_ = make_local(local_groups);
}

void DistributedOptimizer::zero_grad(bool set_to_none) {
  torch::optim::Optimizer::zero_grad(set_to_none);
  shards_->zero_gradients();
}

at::Tensor DistributedOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (size_t g = 0; g < param_groups().size(); ++g) {
    local_->param_groups()[g].set_options(param_groups()[g].options().clone());
  }
  shards_->take_gradients();
  {
    at::NoGradGuard no_grad;
    local_->step();
  }
  shards_->release_gradients();
  shards_->gather_parameters();
  return loss;
}

}  // namespace torch_mp::optim
