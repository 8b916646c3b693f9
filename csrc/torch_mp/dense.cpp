#include "torch_mp/dense.h"

#include <ATen/ATen.h>

#include "torch_mp/activation.h"
#include "torch_mp/moe/experts.h"
#include "torch_mp/moe/moe.h"
#include "torch_mp/moe/router.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::dense {

MLPImpl::MLPImpl(MLPOptions options_) : options(std::move(options_)) { reset(); }

void MLPImpl::reset() {
  check_activation(options.activation());
  fc1 = register_module(
      "fc1",
      torch::nn::Linear(torch::nn::LinearOptions(options.hidden_size(), options.ffn_hidden_size())
                            .bias(options.bias())));
  fc2 = register_module(
      "fc2",
      torch::nn::Linear(torch::nn::LinearOptions(options.ffn_hidden_size(), options.hidden_size())
                            .bias(options.bias())));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  const auto inner = activation(fc1(x), options.activation());
  return fc2(at::dropout(inner, options.dropout(), is_training()));
}

ConvBlockImpl::ConvBlockImpl(ConvBlockOptions options_) : options(std::move(options_)) { reset(); }

void ConvBlockImpl::reset() {
  const auto& o = options;
  const int64_t padding = o.padding().value_or(o.kernel_size() / 2);
  conv1 = register_module(
      "conv1",
      torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels(), o.mid_channels(), o.kernel_size())
                            .padding(padding)
                            .bias(o.bias())));
  norm = register_module("norm", torch::nn::BatchNorm2d(o.mid_channels()));
  conv2 = register_module("conv2",
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(
                                                o.mid_channels(), o.out_channels(), o.kernel_size())
                                                .padding(padding)
                                                .bias(o.bias())));
}

at::Tensor ConvBlockImpl::forward(const at::Tensor& x) { return conv2(at::relu(norm(conv1(x)))); }

LayerNormImpl::LayerNormImpl(LayerNormOptions options_) : options(std::move(options_)) { reset(); }

void LayerNormImpl::reset() {
  weight = register_parameter("weight", at::ones({options.hidden_size()}));
  if (options.bias()) {
    bias = register_parameter("bias", at::zeros({options.hidden_size()}));
  }
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return at::layer_norm(x, {options.hidden_size()}, weight, bias, options.eps());
}

TransformerLayerImpl::TransformerLayerImpl(TransformerLayerOptions options_)
    : options(std::move(options_)) {
  reset();
}

void TransformerLayerImpl::reset() {
  const auto& o = options;
  check_activation(o.activation());
  // Registered (and drawn) in torch.nn.TransformerEncoderLayer's order.
  self_attn = register_module("self_attn",
                              torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(
                                                                o.hidden_size(), o.num_heads())
                                                                .dropout(o.dropout())
                                                                .bias(o.bias())));
  linear1 = register_module(
      "linear1",
      torch::nn::Linear(
          torch::nn::LinearOptions(o.hidden_size(), o.ffn_hidden_size()).bias(o.bias())));
  linear2 = register_module(
      "linear2",
      torch::nn::Linear(
          torch::nn::LinearOptions(o.ffn_hidden_size(), o.hidden_size()).bias(o.bias())));
  const auto norm_options =
      LayerNormOptions(o.hidden_size()).eps(o.layer_norm_eps()).bias(o.bias());
  norm1 = register_module("norm1", LayerNorm(norm_options));
  norm2 = register_module("norm2", LayerNorm(norm_options));
}

at::Tensor TransformerLayerImpl::forward(const at::Tensor& x, const at::Tensor& attn_mask) {
  const double p = options.dropout();
  const bool training = is_training();
  const auto attention = [&](const at::Tensor& t) {
    const auto out =
        std::get<0>(self_attn->forward(t, t, t, {}, /*need_weights=*/false, attn_mask));
    return at::dropout(out, p, training);
  };
  const auto feed_forward = [&](const at::Tensor& t) {
    const auto inner = at::dropout(activation(linear1(t), options.activation()), p, training);
    return at::dropout(linear2(inner), p, training);
  };
  if (options.norm_first()) {
    const auto y = x + attention(norm1(x));
    return y + feed_forward(norm2(y));
  }
  const auto y = norm1(x + attention(x));
  return norm2(y + feed_forward(y));
}

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
