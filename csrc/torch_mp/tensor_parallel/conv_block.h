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
#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/tensor_parallel/conv.h"

namespace torch_mp::tensor_parallel {

/// Copies this rank's channels of a dense BatchNorm2d (parameters and running statistics).
void load_dense_batch_norm_(torch::nn::BatchNorm2d& local,
                            const torch::nn::BatchNorm2d& dense,
                            const GroupPtr& group);

/// The options of ParallelConvBlock, declared once (torch_mp/options.h):
/// - in_channels, mid_channels, out_channels: the channels in, between the convolutions (the
///   group size must divide them) and out;
/// - kernel_size: of both convolutions;
/// - padding: of both convolutions (default: kernel_size / 2, "same" for odd kernels);
/// - bias: biases on both convolutions;
/// - group: the tensor-parallel group; the default mesh's when null.
#define TORCH_MP_PARALLEL_CONV_BLOCK_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, in_channels)                                        \
  REQUIRED(int64_t, mid_channels)                                       \
  REQUIRED(int64_t, out_channels)                                       \
  OPTION(int64_t, kernel_size, 3)                                       \
  OPTION(std::optional<int64_t>, padding, std::nullopt)                 \
  OPTION(bool, bias, true)                                              \
  OPTION(GroupPtr, group, {})

/// Options of ParallelConvBlock.
struct ParallelConvBlockOptions {
  TORCH_MP_OPTIONS(ParallelConvBlockOptions, TORCH_MP_PARALLEL_CONV_BLOCK_OPTIONS)
  ParallelConvBlockOptions(int64_t in_channels,
                           int64_t mid_channels,
                           int64_t out_channels,
                           int64_t kernel_size)
      : ParallelConvBlockOptions(in_channels, mid_channels, out_channels) {
    kernel_size_ = kernel_size;
  }
};

/// Checks a convolutional block's options: positive sizes, mid_channels divisible by the size
/// of options.group() (which must be set), and the same options on every rank.
void check_parallel_conv_block(const ParallelConvBlockOptions& options);

/// The options of a block's convolutions: conv1 (in -> mid, column-parallel) and conv2 (mid ->
/// out, row-parallel), both with the block's kernel, padding and bias.
ColumnParallelConv2dOptions conv1_options(const ParallelConvBlockOptions& options);
RowParallelConv2dOptions conv2_options(const ParallelConvBlockOptions& options);

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
