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

}  // namespace torch_mp::dense
