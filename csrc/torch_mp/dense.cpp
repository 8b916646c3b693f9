#include "torch_mp/dense.h"

#include <ATen/ATen.h>

#include "torch_mp/activation.h"

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

}  // namespace torch_mp::dense
