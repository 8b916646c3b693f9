#include "torch_mp/moe/dense_moe.h"

#include <ATen/ATen.h>

#include "torch_mp/moe/experts.h"
#include "torch_mp/moe/moe.h"
#include "torch_mp/moe/router.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::dense {

ExpertsImpl::ExpertsImpl(int64_t hidden_size_,
                         int64_t ffn_hidden_size_,
                         int64_t num_experts_,
                         std::string activation_,
                         bool bias_)
    : hidden_size(hidden_size_),
      ffn_hidden_size(ffn_hidden_size_),
      num_experts(num_experts_),
      activation(std::move(activation_)),
      bias(bias_) {
  reset();
}

void ExpertsImpl::reset() {
  moe::check_expert_activation(activation);
  TORCH_CHECK(num_experts >= 0 && hidden_size >= 0 && ffn_hidden_size >= 0,
              "Experts: sizes must not be negative");
  const int64_t rows = ffn_hidden_size * moe::fc1_rows_per_unit(activation);
  fc1_weight = register_parameter("fc1_weight", at::empty({num_experts, rows, hidden_size}));
  fc2_weight =
      register_parameter("fc2_weight", at::empty({num_experts, hidden_size, ffn_hidden_size}));
  if (bias) {
    fc1_bias = register_parameter("fc1_bias", at::empty({num_experts, rows}));
    fc2_bias = register_parameter("fc2_bias", at::empty({num_experts, hidden_size}));
  }
  reset_parameters();
}

void ExpertsImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  for (int64_t i = 0; i < num_experts; ++i) {
    for (auto [weight, b] : {std::pair{fc1_weight, fc1_bias}, std::pair{fc2_weight, fc2_bias}}) {
      torch::nn::Linear linear(torch::nn::LinearOptions(weight.size(2), weight.size(1)).bias(bias));
      weight[i].copy_(linear->weight);
      if (bias) {
        b[i].copy_(linear->bias);
      }
    }
  }
}

at::Tensor expert_mlp(const at::Tensor& x,
                      int64_t i,
                      const at::Tensor& fc1_weight,
                      const std::optional<at::Tensor>& fc1_bias,
                      const at::Tensor& fc2_weight,
                      const std::optional<at::Tensor>& fc2_bias,
                      const std::string& activation) {
  const auto b1 = fc1_bias ? std::optional<at::Tensor>((*fc1_bias)[i]) : std::nullopt;
  const auto b2 = fc2_bias ? std::optional<at::Tensor>((*fc2_bias)[i]) : std::nullopt;
  return at::linear(
      moe::expert_activation(at::linear(x, fc1_weight[i], b1), activation), fc2_weight[i], b2);
}

at::Tensor ExpertsImpl::expert(int64_t i, const at::Tensor& x) const {
  return expert_mlp(x,
                    i,
                    fc1_weight,
                    tensor_parallel::optional_tensor(fc1_bias),
                    fc2_weight,
                    tensor_parallel::optional_tensor(fc2_bias),
                    activation);
}

void check_moe(const MoEOptions& o) {
  moe::check_routing(o.num_experts(), o.top_k(), o.router(), o.capacity_factor());
  moe::check_expert_activation(o.activation());
}

MoEImpl::MoEImpl(MoEOptions options_) : options(std::move(options_)) { reset(); }

void MoEImpl::reset() {
  const auto& o = options;
  check_moe(o);
  router = register_module(
      "router",
      torch::nn::Linear(torch::nn::LinearOptions(o.hidden_size(), o.num_experts()).bias(false)));
  experts = register_module(
      "experts",
      Experts(o.hidden_size(), o.ffn_hidden_size(), o.num_experts(), o.activation(), o.bias()));
}

std::tuple<at::Tensor, at::Tensor> MoEImpl::forward(const at::Tensor& x) {
  using tensor_parallel::optional_tensor;
  return moe::moe_forward(x,
                          {router->weight,
                           experts->fc1_weight,
                           optional_tensor(experts->fc1_bias),
                           experts->fc2_weight,
                           optional_tensor(experts->fc2_bias)},
                          options,
                          nullptr);
}

}  // namespace torch_mp::dense
