#include "torch_mp/tensor_parallel/conv_block.h"

#include <ATen/ATen.h>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/tensor_parallel/linear.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

// The convolutions' padding: the option, else "same" for an odd kernel (kernel_size / 2).
int64_t padding_of(const ParallelConvBlockOptions& o) {
  return o.padding().value_or(o.kernel_size() / 2);
}

}  // namespace

void check_parallel_conv_block(const ParallelConvBlockOptions& o) {
  TORCH_CHECK(o.group(), "ParallelConvBlock: options.group() is not set");
  options::check_same_options(o, o.group(), "ParallelConvBlock");
  TORCH_CHECK(o.in_channels() > 0 && o.mid_channels() > 0 && o.out_channels() > 0 &&
                  o.kernel_size() > 0 && padding_of(o) >= 0,
              "ParallelConvBlock: channels and kernel_size must be positive and padding "
              "non-negative, got ",
              options::describe(o));
  divide(o.mid_channels(), o.group()->getSize(), "ParallelConvBlock: mid_channels");
}

ColumnParallelConv2dOptions conv1_options(const ParallelConvBlockOptions& o) {
  return ColumnParallelConv2dOptions(o.in_channels(), o.mid_channels(), o.kernel_size())
      .padding(torch::ExpandingArray<2>(padding_of(o)))
      .bias(o.bias())
      .group(o.group());
}

RowParallelConv2dOptions conv2_options(const ParallelConvBlockOptions& o) {
  return RowParallelConv2dOptions(o.mid_channels(), o.out_channels(), o.kernel_size())
      .padding(torch::ExpandingArray<2>(padding_of(o)))
      .bias(o.bias())
      .group(o.group());
}

void load_dense_batch_norm_(torch::nn::BatchNorm2d& local,
                            const torch::nn::BatchNorm2d& dense,
                            const GroupPtr& group) {
  at::NoGradGuard no_grad;
  auto copy = [&](at::Tensor& to, const at::Tensor& from) {
    if (to.defined()) {
      to.copy_(shard(from, 0, group));
    }
  };
  copy(local->weight, dense->weight);
  copy(local->bias, dense->bias);
  copy(local->running_mean, dense->running_mean);
  copy(local->running_var, dense->running_var);
  if (local->num_batches_tracked.defined()) {
    local->num_batches_tracked.copy_(dense->num_batches_tracked);
  }
}

// ---- ParallelConvBlock ------------------------------------------------------------------------

ParallelConvBlockImpl::ParallelConvBlockImpl(ParallelConvBlockOptions options_, bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelConvBlockImpl::register_layouts() {
  // This rank's channels: the norm's parameters and running statistics.
  for (const auto& t : {norm->weight, norm->bias, norm->running_mean, norm->running_var}) {
    if (t.defined()) {
      set_sharded(t, 0, options.group());
    }
  }
}

std::shared_ptr<torch::nn::Module> ParallelConvBlockImpl::clone(
    const std::optional<torch::Device>& device) const {
  auto copy = Cloneable::clone(device);
  std::dynamic_pointer_cast<ParallelConvBlockImpl>(copy)->register_layouts();
  return copy;
}

void ParallelConvBlockImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& o = options;
  check_parallel_conv_block(o);
  conv1 = register_module("conv1", ColumnParallelConv2dImpl::uninitialised(conv1_options(o)));
  norm = register_module("norm", torch::nn::BatchNorm2d(o.mid_channels() / o.group()->getSize()));
  conv2 = register_module("conv2", RowParallelConv2dImpl::uninitialised(conv2_options(o)));
  register_layouts();
  if (initialise_) {
    reset_parameters();
  }
}

void ParallelConvBlockImpl::reset_parameters() {
  conv1->reset_parameters();
  conv2->reset_parameters();
}

at::Tensor ParallelConvBlockImpl::forward(const at::Tensor& x) {
  return conv2(at::relu(norm(conv1(x))));
}

ParallelConvBlock ParallelConvBlockImpl::from_dense(const torch::nn::Conv2d& dense1,
                                                    const torch::nn::BatchNorm2d& dense_norm,
                                                    const torch::nn::Conv2d& dense2,
                                                    GroupPtr group) {
  const auto& a = dense1->options;
  const auto& b = dense2->options;
  const auto simple = [](const auto& c) {
    const auto* p = std::get_if<torch::ExpandingArray<2>>(&c.padding());
    return p && (**p)[0] == (**p)[1] && (*c.kernel_size())[0] == (*c.kernel_size())[1] &&
           *c.stride() == std::array<int64_t, 2>{1, 1} &&
           *c.dilation() == std::array<int64_t, 2>{1, 1} && c.groups() == 1 &&
           std::holds_alternative<torch::enumtype::kZeros>(c.padding_mode());
  };
  TORCH_CHECK(simple(a) && simple(b) && *a.kernel_size() == *b.kernel_size() &&
                  *std::get<torch::ExpandingArray<2>>(a.padding()) ==
                      *std::get<torch::ExpandingArray<2>>(b.padding()) &&
                  a.bias() == b.bias() && a.out_channels() == b.in_channels() &&
                  dense_norm->options.num_features() == a.out_channels(),
              "ParallelConvBlock.from_dense: expects conv1 [in -> mid] and conv2 [mid -> out] "
              "with the same square kernel, symmetric padding, stride 1, dilation 1, bias "
              "setting and zero padding mode, and a BatchNorm2d over mid channels");
  auto options = ParallelConvBlockOptions(
                     a.in_channels(), a.out_channels(), b.out_channels(), (*a.kernel_size())[0])
                     .padding((*std::get<torch::ExpandingArray<2>>(a.padding()))[0])
                     .bias(a.bias())
                     .group(std::move(group));
  auto block = ParallelConvBlock(std::shared_ptr<ParallelConvBlockImpl>(
      new ParallelConvBlockImpl(std::move(options), /*initialise=*/false)));
  block->norm->options.eps(dense_norm->options.eps()).momentum(dense_norm->options.momentum());
  block->to(dense1->weight.device(), dense1->weight.scalar_type());
  const auto& g = block->options.group();
  load_dense_linear_(block->conv1->weight,
                     optional_tensor(block->conv1->bias),
                     dense1->weight,
                     optional_tensor(dense1->bias),
                     0,
                     g);
  load_dense_linear_(block->conv2->weight,
                     optional_tensor(block->conv2->bias),
                     dense2->weight,
                     optional_tensor(dense2->bias),
                     1,
                     g);
  load_dense_batch_norm_(block->norm, dense_norm, g);
  return block;
}

ParallelConvBlock ParallelConvBlockImpl::from_dense(const dense::ConvBlock& block, GroupPtr group) {
  return from_dense(block->conv1, block->norm, block->conv2, std::move(group));
}

}  // namespace torch_mp::tensor_parallel
