#include "torch_mp/pipeline/pipeline.h"

#include "torch_mp/mesh.h"

namespace torch_mp::pipeline {
namespace {

GroupPtr group_or_default(const GroupPtr& group) { return group ? group : get_mesh()->pp_group; }

}  // namespace

Stage stage_of(torch::nn::Sequential module) {
  std::vector<at::Tensor> parameters = module->parameters();
  return Stage{[module](const std::vector<at::Tensor>& inputs) mutable -> std::vector<at::Tensor> {
                 TORCH_CHECK(inputs.size() == 1,
                             "Pipeline: a torch::nn::Sequential stage takes one tensor, got ",
                             inputs.size());
                 return {module->forward(inputs[0])};
               },
               std::move(parameters)};
}

Pipeline::Pipeline(std::vector<Stage> stages, LossFn loss, PipelineOptions options) {
  const GroupPtr group = group_or_default(options.group());
  const auto per_rank = static_cast<int64_t>(stages.size());
  Schedule schedule = make_schedule(
      options.schedule(), group->getSize() * per_rank, options.num_microbatches(), per_rank);
  executor_ =
      std::make_unique<Executor>(std::move(schedule), std::move(stages), std::move(loss), group);
}

Pipeline::Pipeline(std::vector<Stage> stages, LossFn loss, Schedule schedule, GroupPtr group)
    : executor_(std::make_unique<Executor>(
          std::move(schedule), std::move(stages), std::move(loss), group_or_default(group))) {}

std::vector<std::vector<at::Tensor>> Pipeline::split(const std::vector<at::Tensor>& batch) const {
  if (batch.empty()) {
    return {};
  }
  return split_microbatches(batch, schedule().num_microbatches);
}

std::optional<at::Tensor> Pipeline::step(const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& targets) {
  return executor_->step(split(inputs), split(targets));
}

std::pair<std::vector<at::Tensor>, std::optional<at::Tensor>> Pipeline::eval_step(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) {
  return executor_->eval_step(split(inputs), split(targets));
}

}  // namespace torch_mp::pipeline
