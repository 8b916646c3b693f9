#pragma once
// Column- and row-parallel Linear layers (Megatron-style), as functions and as torch::nn modules.
//
//   ColumnParallelLinear   Y_i = X A_i^T + b_i      weight [out/t, in]: rows of the dense weight
//   RowParallelLinear      Y = sum_i X_i A_i^T + b  weight [out, in/t]: columns of the dense weight
//
// A column layer followed by a row layer (an MLP) needs one all-reduce forward and one backward.
// The two forwards are also PyTorch operators, torch.ops.torch_mp.column_parallel_linear and
// row_parallel_linear (input, weight, bias_tensor, *, <the declared options below>, the group by
// name): compositions of ATen's and the collectives' operators, which is what the Python modules
// call, eager and compiled alike.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <ostream>

#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

// ---- functions shared by the C++ and Python modules ------------------------------------------

/// Forward of a column-parallel linear layer.
///
/// `weight` is this rank's [out_features / t, in_features] shard, `bias` its [out_features / t]
/// shard. The input is copied into the tensor-parallel region (its gradient all-reduced) or, with
/// `sequence_parallel`, all-gathered along dim 0 (the sequence dim of [s, b, h] tensors).
/// Returns this rank's output columns, or all of them with `gather_output`.
/// Raises if the shard does not match `out_features` split over the group.
at::Tensor column_parallel_linear(const at::Tensor& input,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  int64_t out_features,
                                  bool gather_output,
                                  bool sequence_parallel,
                                  const GroupPtr& group);

/// Forward of a row-parallel linear layer.
///
/// `weight` is this rank's [out_features, in_features / t] shard; `bias` is whole and added once,
/// after the reduction. With `input_is_parallel` the input is already this rank's slice of the
/// last dim, otherwise it is split here. Partial products are all-reduced or, with
/// `sequence_parallel`, reduce-scattered along dim 0.
/// Raises if the shard does not match `in_features` split over the group.
at::Tensor row_parallel_linear(const at::Tensor& input,
                               const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias,
                               int64_t in_features,
                               bool input_is_parallel,
                               bool sequence_parallel,
                               const GroupPtr& group);

/// Fills the shards `weight` (and `bias`) with this rank's part of a dense [out, in] Linear
/// initialised exactly as torch.nn.Linear does (Kaiming-uniform weight, uniform(+-1/sqrt(in))
/// bias). Ranks seeded alike hold shards of one dense layer, and that layer equals the
/// nn.Linear the same seed would give. `shard_dim` is 0 for column, 1 for row layers; a row
/// layer's bias is whole.
void init_parallel_linear_(at::Tensor& weight,
                           std::optional<at::Tensor> bias,
                           int64_t in_features,
                           int64_t out_features,
                           int64_t shard_dim,
                           const GroupPtr& group);

/// Copies this rank's shard of a dense Linear (`dense_weight`, `dense_bias`) into `weight` and
/// `bias`: the weight's chunk along `shard_dim` (0 for column, 1 for row layers), the bias's
/// chunk for column layers and the whole bias for row layers. Not differentiable.
void load_dense_linear_(at::Tensor& weight,
                        std::optional<at::Tensor> bias,
                        const at::Tensor& dense_weight,
                        const std::optional<at::Tensor>& dense_bias,
                        int64_t shard_dim,
                        const GroupPtr& group);

/// The dense weight and bias that the ranks' shards make up (the inverse of load_dense_linear_;
/// a collective, every rank gets them).
std::pair<at::Tensor, std::optional<at::Tensor>> gather_dense_linear(
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    int64_t shard_dim,
    const GroupPtr& group);

// ---- torch::nn modules -----------------------------------------------------------------------

class ColumnParallelLinear;
class RowParallelLinear;

/// The options of ColumnParallelLinear, declared once (torch_mp/options.h):
/// - in_features: size of each input sample;
/// - out_features: size of each output sample (of the dense layer); the group size divides it;
/// - bias: whether the layer has a bias;
/// - gather_output: all-gather the output so every rank gets all out_features;
/// - sequence_parallel: input sharded along the sequence dim (0), all-gathered before the
///   product;
/// - group: the tensor-parallel group; the default mesh's when null.
#define TORCH_MP_COLUMN_PARALLEL_LINEAR_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, in_features)                                           \
  REQUIRED(int64_t, out_features)                                          \
  OPTION(bool, bias, true)                                                 \
  OPTION(bool, gather_output, false)                                       \
  OPTION(bool, sequence_parallel, false)                                   \
  OPTION(GroupPtr, group, {})

/// Options of ColumnParallelLinear.
struct ColumnParallelLinearOptions {
  using Holder = ColumnParallelLinear;
  static constexpr int64_t kShardDim = 0;
  static constexpr const char* kName = "ColumnParallelLinear";
  /// gather_output, under the name the layer template uses for either option.
  bool flag() const { return gather_output_; }
  TORCH_MP_OPTIONS(ColumnParallelLinearOptions, TORCH_MP_COLUMN_PARALLEL_LINEAR_OPTIONS)
};

/// The options of RowParallelLinear, declared once (torch_mp/options.h):
/// - in_features: size of each input sample (of the dense layer); the group size divides it;
/// - out_features: size of each output sample;
/// - bias: whether the layer has a bias (whole on every rank, added after the reduction);
/// - input_is_parallel: the input is already split along its last dim (a column layer's
///   output);
/// - sequence_parallel: reduce-scatter the output along the sequence dim (0) instead of
///   all-reducing it;
/// - group: the tensor-parallel group; the default mesh's when null.
#define TORCH_MP_ROW_PARALLEL_LINEAR_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, in_features)                                        \
  REQUIRED(int64_t, out_features)                                       \
  OPTION(bool, bias, true)                                              \
  OPTION(bool, input_is_parallel, true)                                 \
  OPTION(bool, sequence_parallel, false)                                \
  OPTION(GroupPtr, group, {})

/// Options of RowParallelLinear.
struct RowParallelLinearOptions {
  using Holder = RowParallelLinear;
  static constexpr int64_t kShardDim = 1;
  static constexpr const char* kName = "RowParallelLinear";
  /// input_is_parallel, under the name the layer template uses for either option.
  bool flag() const { return input_is_parallel_; }
  TORCH_MP_OPTIONS(RowParallelLinearOptions, TORCH_MP_ROW_PARALLEL_LINEAR_OPTIONS)
};

/// Checks a column-parallel layer's options: sizes divisible by the size of options.group()
/// (which must be set), no `gather_output` together with `sequence_parallel`, and the same
/// options on every rank of the group (one small all-gather). Raises with the reason otherwise.
void check_column_parallel_linear(const ColumnParallelLinearOptions& options);

/// The same checks for a row-parallel layer (`sequence_parallel` needs `input_is_parallel`).
void check_row_parallel_linear(const RowParallelLinearOptions& options);

/// A Linear layer whose output (Column) or input (Row) features are split across the
/// tensor-parallel group.
template <typename Options>
class ParallelLinearImpl : public torch::nn::Cloneable<ParallelLinearImpl<Options>> {
 public:
  ParallelLinearImpl(int64_t in_features, int64_t out_features)
      : ParallelLinearImpl(Options(in_features, out_features)) {}
  explicit ParallelLinearImpl(Options options)
      : ParallelLinearImpl(std::move(options), /*initialise=*/true) {}

  /// Checks the options and registers and initialises the parameters.
  void reset() override;
  /// Re-draws the parameters (see init_parallel_linear_).
  void reset_parameters();
  /// Applies the layer (see column_parallel_linear / row_parallel_linear).
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// A layer whose parameters are allocated but not initialised (for modules that fill them).
  static typename Options::Holder uninitialised(Options options);
  /// Shards `dense` for `options.group()`; `options` must name the dense layer's sizes and bias.
  static typename Options::Holder from_dense(const torch::nn::Linear& dense, Options options);
  /// The dense layer, gathered from every rank (a collective: call it on all ranks).
  torch::nn::Linear to_dense() const;

  Options options;
  /// This rank's shard of the weight: [out_features / t, in_features] (Column) or
  /// [out_features, in_features / t] (Row).
  at::Tensor weight;
  /// This rank's [out_features / t] shard of the bias (Column) or the whole [out_features] bias
  /// (Row); undefined without bias.
  at::Tensor bias;

 private:
  // from_dense copies the parameters instead of drawing them, leaving the default random
  // generator untouched (sharding a model must not change the data a program draws next).
  ParallelLinearImpl(Options options, bool initialise);
  bool initialise_ = true;
};

using ColumnParallelLinearImpl = ParallelLinearImpl<ColumnParallelLinearOptions>;
using RowParallelLinearImpl = ParallelLinearImpl<RowParallelLinearOptions>;
extern template class ParallelLinearImpl<ColumnParallelLinearOptions>;
extern template class ParallelLinearImpl<RowParallelLinearOptions>;

/// Holder of ColumnParallelLinearImpl, used like torch::nn::Linear.
TORCH_MODULE(ColumnParallelLinear);
/// Holder of RowParallelLinearImpl, used like torch::nn::Linear.
TORCH_MODULE(RowParallelLinear);

}  // namespace torch_mp::tensor_parallel
