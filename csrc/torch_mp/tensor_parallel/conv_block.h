#pragma once
// A convolutional block with its middle channels split across the tensor-parallel group:
// Conv2d (output channels split) -> BatchNorm2d (this rank's channels) -> ReLU -> Conv2d (input
// channels split, all-reduced): one all-reduce forward, one backward. BatchNorm acts on each
// channel alone, so its shard is exact, running statistics included. Equals
// torch_mp::dense::ConvBlock given the same weights; from_dense shards one.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <optional>

#include "torch_mp/dense.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/tensor_parallel/conv.h"

namespace torch_mp::tensor_parallel {

/// Checks a convolutional block's configuration: positive sizes, mid_channels divisible by the
/// group size, and the same configuration on every rank.
void check_parallel_conv_block(int64_t in_channels,
                               int64_t mid_channels,
                               int64_t out_channels,
                               int64_t kernel_size,
                               int64_t padding,
                               bool bias,
                               const GroupPtr& group);

/// Copies this rank's channels of a dense BatchNorm2d (parameters and running statistics).
void load_dense_batch_norm_(torch::nn::BatchNorm2d& local,
                            const torch::nn::BatchNorm2d& dense,
                            const GroupPtr& group);

/// Options of ParallelConvBlock.
struct ParallelConvBlockOptions {
  ParallelConvBlockOptions(int64_t in_channels,
                           int64_t mid_channels,
                           int64_t out_channels,
                           int64_t kernel_size = 3)
      : in_channels_(in_channels),
        mid_channels_(mid_channels),
        out_channels_(out_channels),
        kernel_size_(kernel_size) {}
  TORCH_ARG(int64_t, in_channels);
  /// Channels between the convolutions; the group size must divide it.
  TORCH_ARG(int64_t, mid_channels);
  TORCH_ARG(int64_t, out_channels);
  TORCH_ARG(int64_t, kernel_size);
  /// Padding of both convolutions (default: kernel_size / 2, "same" for odd kernels).
  TORCH_ARG(std::optional<int64_t>, padding) = std::nullopt;
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(GroupPtr, group) = {};
};

class ParallelConvBlock;

/// Conv2d (output channels split) -> BatchNorm2d (this rank's channels) -> ReLU -> Conv2d
/// (input channels split, all-reduced): one all-reduce forward, one backward.
class ParallelConvBlockImpl : public torch::nn::Cloneable<ParallelConvBlockImpl> {
 public:
  explicit ParallelConvBlockImpl(ParallelConvBlockOptions options)
      : ParallelConvBlockImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws conv1 then conv2 as torch::nn::Conv2d layers would be drawn.
  void reset_parameters();
  at::Tensor forward(const at::Tensor& x);
  /// Shards the dense conv1 -> norm -> (ReLU) -> conv2.
  static ParallelConvBlock from_dense(const torch::nn::Conv2d& conv1,
                                      const torch::nn::BatchNorm2d& norm,
                                      const torch::nn::Conv2d& conv2,
                                      GroupPtr group = {});
  /// Shards a torch_mp::dense::ConvBlock.
  static ParallelConvBlock from_dense(const dense::ConvBlock& block, GroupPtr group = {});
  /// A deep copy, its layouts recorded (Cloneable's copy replaces the children's tensors).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  ParallelConvBlockOptions options;
  ColumnParallelConv2d conv1 = nullptr;
  torch::nn::BatchNorm2d norm = nullptr;
  RowParallelConv2d conv2 = nullptr;

 private:
  ParallelConvBlockImpl(ParallelConvBlockOptions options, bool initialise);
  void register_layouts();
  bool initialise_ = true;
};
TORCH_MODULE(ParallelConvBlock);

}  // namespace torch_mp::tensor_parallel
