#include "torch_mp/data_parallel/gradient_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

namespace torch_mp::data_parallel {

GradientHooks::GradientHooks(const std::vector<at::Tensor>& parameters,
                             std::function<void(size_t)> on_gradient) {
  auto shared = std::make_shared<std::function<void(size_t)>>(std::move(on_gradient));
  for (size_t i = 0; i < parameters.size(); ++i) {
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(parameters[i]));
    keys_.push_back(accumulators_.back()->add_post_hook(
        std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [shared, i](const torch::autograd::variable_list& outputs,
                        const torch::autograd::variable_list&) {
              (*shared)(i);
              return outputs;
            })));
  }
}

GradientHooks::~GradientHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(keys_[i]);
  }
}

ArmedBackward::ArmedBackward(const std::vector<at::Tensor>& parameters,
                             const std::vector<std::string>& names)
    : ready_(parameters.size(), false) {
  TORCH_CHECK(names.empty() || names.size() == parameters.size(),
              "DataParallel: ",
              names.size(),
              " parameter names for ",
              parameters.size(),
              " parameters");
  // Taken now, while every parameter is whole: ZeRO-3 frees them to empty tensors.
  for (size_t i = 0; i < parameters.size(); ++i) {
    labels_.push_back(parameter_name(names, parameters, i));
  }
}

void ArmedBackward::arm() {
  ready_.assign(labels_.size(), false);
  ready_count_ = 0;
  armed_ = true;
}

bool ArmedBackward::mark(size_t i) {
  if (!armed_ || ready_[i]) {
    return false;
  }
  ready_[i] = true;
  if (++ready_count_ == labels_.size()) {
    armed_ = false;
  }
  return true;
}

const std::string& ArmedBackward::name(size_t i) const { return labels_[i]; }

std::string parameter_name(const std::vector<std::string>& names,
                           const std::vector<at::Tensor>& parameters,
                           size_t i) {
  std::ostringstream out;
  if (!names.empty()) {
    out << names[i] << " " << parameters[i].sizes();
  } else {
    out << "parameter " << i << " " << parameters[i].sizes();
  }
  return out.str();
}

void ArmedBackward::check_complete(const std::string& owner) const {
  if (!armed_ || ready_count_ == 0) {
    return;
  }
  std::ostringstream missing;
  size_t count = 0;
  for (size_t i = 0; i < labels_.size(); ++i) {
    if (!ready_[i] && count++ < 8) {
      missing << (count > 1 ? ", " : "") << name(i);
    }
  }
  TORCH_CHECK(false,
              owner,
              ": the synced backward gave no gradient to ",
              count,
              " parameters (",
              missing.str(),
              count > 8 ? ", ..." : "",
              "), so their gradients are not averaged over the data-parallel group; every "
              "parameter must get one in a synced backward (use them all in the forward, or "
              "freeze those unused with requires_grad_(False) before wrapping)");
}

bool has_gradient_hooks(const at::Tensor& parameter) {
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(parameter);
  return accumulator && !accumulator->post_hooks().empty();
}

std::vector<std::string> names_requiring_grad(const std::vector<at::Tensor>& parameters,
                                              const std::vector<std::string>& names,
                                              const std::string& owner) {
  if (names.empty()) {
    return {};
  }
  TORCH_CHECK(names.size() == parameters.size(),
              owner,
              ": ",
              names.size(),
              " parameter names for ",
              parameters.size(),
              " parameters");
  std::vector<std::string> out;
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (parameters[i].requires_grad()) {
      out.push_back(names[i]);
    }
  }
  return out;
}

}  // namespace torch_mp::data_parallel
