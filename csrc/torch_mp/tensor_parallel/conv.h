#pragma once
// Channel-parallel Conv2d layers (NCHW, or CHW unbatched), as functions and torch::nn modules.
//
//   ColumnParallelConv2d   output channels split: weight [out/t, in, kh, kw], bias [out/t]
//   RowParallelConv2d      input channels split:  weight [out, in/t, kh, kw], partial sums
//                          all-reduced, bias (whole) added once after the reduction
//
// Every stride, padding (numbers, "same", "valid"), dilation and padding mode ("zeros",
// "reflect", "replicate", "circular") of torch::nn::Conv2d with groups = 1. Padding acts on each
// channel alone, so it commutes with splitting the channels.
//
// The forwards are also PyTorch operators (compositions, as the linear layers' are):
//   torch.ops.torch_mp.column_parallel_conv2d(input, weight, bias_tensor, *, <the declared
//       ColumnParallelConv2dOptions>)
//   torch.ops.torch_mp.row_parallel_conv2d(input, weight, bias_tensor, *, <the declared
//       RowParallelConv2dOptions>)

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/expanding_array.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <optional>
#include <ostream>
#include <string>
#include <variant>

#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

/// Forward of a column-parallel Conv2d: `weight` [out/t, in, kh, kw] and `bias` [out/t] are this
/// rank's shards of the dense layer that `dense` describes. The input is copied into the
/// tensor-parallel region; the output is this rank's out/t channels, or all of them with
/// `gather_output`.
at::Tensor column_parallel_conv2d(const at::Tensor& input,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const torch::nn::Conv2dOptions& dense,
                                  bool gather_output,
                                  const GroupPtr& group);

/// Forward of a row-parallel Conv2d: `weight` [out, in/t, kh, kw] is this rank's shard, `bias`
/// [out] whole. With `input_is_parallel` the input holds this rank's in/t channels, otherwise it
/// is split here. Partial outputs are all-reduced, then the bias is added.
at::Tensor row_parallel_conv2d(const at::Tensor& input,
                               const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias,
                               const torch::nn::Conv2dOptions& dense,
                               bool input_is_parallel,
                               const GroupPtr& group);

/// Conv2dOptions from torch.nn.Conv2d's arguments as Python spells them: `padding` "same",
/// "valid", or empty for the numbers `padding_size`; `padding_mode` "zeros", "reflect",
/// "replicate" or "circular". Raises on other names.
torch::nn::Conv2dOptions conv2d_options(int64_t in_channels,
                                        int64_t out_channels,
                                        std::array<int64_t, 2> kernel_size,
                                        std::array<int64_t, 2> stride,
                                        const std::string& padding,
                                        std::array<int64_t, 2> padding_size,
                                        std::array<int64_t, 2> dilation,
                                        int64_t groups,
                                        bool bias,
                                        const std::string& padding_mode);

/// The options of a torch::nn::Conv2d module (its `options` member) as Conv2dOptions.
torch::nn::Conv2dOptions conv2d_options_of(const torch::nn::detail::ConvNdOptions<2>& module);

/// The convolution torch::nn::Conv2d with options `dense` computes, with any weight and bias
/// (used by the layers on their shards).
at::Tensor conv2d_as(const at::Tensor& input,
                     const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias,
                     const torch::nn::Conv2dOptions& dense);

// ---- torch::nn modules -----------------------------------------------------------------------

/// A Conv2d's padding as torch.nn.Conv2d takes it: numbers, or "same" or "valid".
using Conv2dPadding = std::variant<torch::ExpandingArray<2>, std::string>;

/// The options the two layers share: torch.nn.Conv2d's (groups must be 1; padding_mode
/// "zeros", "reflect", "replicate" or "circular").
#define TORCH_MP_CONV2D_GEOMETRY_OPTIONS(REQUIRED, OPTION)    \
  REQUIRED(int64_t, in_channels)                              \
  REQUIRED(int64_t, out_channels)                             \
  REQUIRED(torch::ExpandingArray<2>, kernel_size)             \
  OPTION(torch::ExpandingArray<2>, stride, 1)                 \
  OPTION(Conv2dPadding, padding, torch::ExpandingArray<2>(0)) \
  OPTION(torch::ExpandingArray<2>, dilation, 1)               \
  OPTION(int64_t, groups, 1)                                  \
  OPTION(bool, bias, true)                                    \
  OPTION(std::string, padding_mode, "zeros")

/// The options of ColumnParallelConv2d, declared once (torch_mp/options.h): the geometry, then
/// gather_output (all-gather the output channels so every rank gets all of them) and group (the
/// tensor-parallel group; the default mesh's when null).
#define TORCH_MP_COLUMN_PARALLEL_CONV2D_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  TORCH_MP_CONV2D_GEOMETRY_OPTIONS(REQUIRED, OPTION)                       \
  OPTION(bool, gather_output, false)                                       \
  OPTION(GroupPtr, group, {})

/// The options of RowParallelConv2d, declared once: the geometry, then input_is_parallel (the
/// input already holds this rank's in_channels / t channels) and group.
#define TORCH_MP_ROW_PARALLEL_CONV2D_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  TORCH_MP_CONV2D_GEOMETRY_OPTIONS(REQUIRED, OPTION)                    \
  OPTION(bool, input_is_parallel, true)                                 \
  OPTION(GroupPtr, group, {})

/// The dense torch::nn::Conv2d's options that a layer's `options` describe.
template <typename Options>
torch::nn::Conv2dOptions conv2d_geometry(const Options& options);
/// Sets a layer's geometry from a dense torch::nn::Conv2d's options.
template <typename Options>
void set_conv2d_geometry(Options& options, const torch::nn::Conv2dOptions& dense);

/// Options of ColumnParallelConv2d.
struct ColumnParallelConv2dOptions {
  static constexpr int64_t kShardDim = 0;
  static constexpr const char* kName = "ColumnParallelConv2d";
  TORCH_MP_OPTIONS(ColumnParallelConv2dOptions, TORCH_MP_COLUMN_PARALLEL_CONV2D_OPTIONS)
  /// gather_output, under the name the layer template uses for either option.
  bool flag() const { return gather_output_; }
  /// The dense layer's options (in_channels, out_channels, kernel_size, stride, padding,
  /// dilation, bias, padding_mode).
  torch::nn::Conv2dOptions conv() const { return conv2d_geometry(*this); }
  /// Takes the geometry from a dense layer's options.
  ColumnParallelConv2dOptions& conv(const torch::nn::Conv2dOptions& dense) {
    set_conv2d_geometry(*this, dense);
    return *this;
  }
};

/// Options of RowParallelConv2d.
struct RowParallelConv2dOptions {
  static constexpr int64_t kShardDim = 1;
  static constexpr const char* kName = "RowParallelConv2d";
  TORCH_MP_OPTIONS(RowParallelConv2dOptions, TORCH_MP_ROW_PARALLEL_CONV2D_OPTIONS)
  /// input_is_parallel, under the name the layer template uses for either option.
  bool flag() const { return input_is_parallel_; }
  /// The dense layer's options.
  torch::nn::Conv2dOptions conv() const { return conv2d_geometry(*this); }
  /// Takes the geometry from a dense layer's options.
  RowParallelConv2dOptions& conv(const torch::nn::Conv2dOptions& dense) {
    set_conv2d_geometry(*this, dense);
    return *this;
  }
};

/// Checks a channel-parallel Conv2d's options: groups = 1, valid geometry, the split channel
/// count (out_channels for a column layer, in_channels for a row layer) divisible by the size of
/// options.group() (which must be set), and the same options on every rank.
void check_column_parallel_conv2d(const ColumnParallelConv2dOptions& options);
void check_row_parallel_conv2d(const RowParallelConv2dOptions& options);

/// A Conv2d whose output (Column) or input (Row) channels are split across the group.
template <typename Options>
class ParallelConv2dImpl : public torch::nn::Cloneable<ParallelConv2dImpl<Options>> {
 public:
  explicit ParallelConv2dImpl(Options options)
      : ParallelConv2dImpl(std::move(options), /*initialise=*/true) {}

  /// Checks the options and registers and initialises the parameters.
  void reset() override;
  /// Re-draws this rank's shard of a dense layer initialised as torch::nn::Conv2d is.
  void reset_parameters();
  /// Applies the layer (see column_parallel_conv2d / row_parallel_conv2d).
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// A layer whose parameters are allocated but not initialised (for modules that fill them).
  static std::shared_ptr<ParallelConv2dImpl> uninitialised(Options options);
  /// Shards `dense`; `options.conv()` must describe it.
  static std::shared_ptr<ParallelConv2dImpl> from_dense(const torch::nn::Conv2d& dense,
                                                        Options options);
  /// The dense layer, gathered from every rank (a collective).
  torch::nn::Conv2d to_dense() const;

  Options options;
  /// This rank's weight shard.
  at::Tensor weight;
  /// This rank's bias shard (Column) or the whole bias (Row); undefined without bias.
  at::Tensor bias;

 private:
  ParallelConv2dImpl(Options options, bool initialise);
  bool initialise_ = true;
};

using ColumnParallelConv2dImpl = ParallelConv2dImpl<ColumnParallelConv2dOptions>;
using RowParallelConv2dImpl = ParallelConv2dImpl<RowParallelConv2dOptions>;
extern template class ParallelConv2dImpl<ColumnParallelConv2dOptions>;
extern template class ParallelConv2dImpl<RowParallelConv2dOptions>;

/// Holder of ColumnParallelConv2dImpl, used like torch::nn::Conv2d.
TORCH_MODULE(ColumnParallelConv2d);
/// Holder of RowParallelConv2dImpl, used like torch::nn::Conv2d.
TORCH_MODULE(RowParallelConv2d);

}  // namespace torch_mp::tensor_parallel
