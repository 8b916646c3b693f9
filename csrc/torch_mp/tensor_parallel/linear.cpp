#include "torch_mp/tensor_parallel/linear.h"

#include <ATen/ATen.h>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"
#include "torch_mp/mesh.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {

at::Tensor column_parallel_linear(const at::Tensor& input,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  int64_t out_features,
                                  bool gather_output,
                                  bool sequence_parallel,
                                  const GroupPtr& group) {
  check_shard_size("ColumnParallelLinear", "out_features", weight.size(0), out_features, group);
  const at::Tensor x =
      sequence_parallel ? gather_from_sp(input, group, 0) : copy_to_tp(input, group);
  const at::Tensor y = at::linear(x, weight, bias);
  return gather_output ? gather_from_tp(y, group, -1) : y;
}

at::Tensor row_parallel_linear(const at::Tensor& input,
                               const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias,
                               int64_t in_features,
                               bool input_is_parallel,
                               bool sequence_parallel,
                               const GroupPtr& group) {
  check_shard_size("RowParallelLinear", "in_features", weight.size(1), in_features, group);
  const at::Tensor x = input_is_parallel ? input : scatter_to_tp(input, group, -1);
  const at::Tensor partial = at::linear(x, weight);
  const at::Tensor y =
      sequence_parallel ? reduce_scatter_to_sp(partial, group, 0) : reduce_from_tp(partial, group);
  if (!bias || !bias->defined()) {
    return y;
  }
  // Under sequence parallelism each rank adds the bias to its own rows only; copy_to_tp sums
  // the bias gradient over the group, so every rank holds the gradient of all rows.
  return y + (sequence_parallel ? copy_to_tp(*bias, group) : *bias);
}

void check_column_parallel_linear(int64_t in_features,
                                  int64_t out_features,
                                  bool bias,
                                  bool gather_output,
                                  bool sequence_parallel,
                                  const GroupPtr& group) {
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  comm::check_same_across_ranks(
      {in_features, out_features, bias, gather_output, sequence_parallel},
      group,
      "ColumnParallelLinear configuration [in_features, out_features, bias, gather_output, "
      "sequence_parallel]");
  check_non_negative(in_features, "ColumnParallelLinear: in_features");
  divide(out_features, group->getSize(), "ColumnParallelLinear: out_features");
  TORCH_CHECK(!(gather_output && sequence_parallel),
              "ColumnParallelLinear: gather_output and sequence_parallel cannot both be set "
              "(a sequence-parallel layer hands its split output to a RowParallelLinear)");
}

void check_row_parallel_linear(int64_t in_features,
                               int64_t out_features,
                               bool bias,
                               bool input_is_parallel,
                               bool sequence_parallel,
                               const GroupPtr& group) {
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  comm::check_same_across_ranks(
      {in_features, out_features, bias, input_is_parallel, sequence_parallel},
      group,
      "RowParallelLinear configuration [in_features, out_features, bias, input_is_parallel, "
      "sequence_parallel]");
  divide(in_features, group->getSize(), "RowParallelLinear: in_features");
  check_non_negative(out_features, "RowParallelLinear: out_features");
  TORCH_CHECK(input_is_parallel || !sequence_parallel,
              "RowParallelLinear: sequence_parallel needs input_is_parallel=True");
}

void init_parallel_linear_(at::Tensor& weight,
                           std::optional<at::Tensor> bias,
                           int64_t in_features,
                           int64_t out_features,
                           int64_t shard_dim,
                           const GroupPtr& group) {
  const int64_t whole = shard_dim == 0 ? in_features : out_features;  // the dim not split
  TORCH_CHECK(weight.dim() == 2 && weight.size(1 - shard_dim) == whole,
              "init_parallel_linear_: the weight shard does not fit the layer's sizes");
  init_sharded_like_dense_(weight, std::move(bias), shard_dim, group);
}

void load_dense_linear_(at::Tensor& weight,
                        std::optional<at::Tensor> bias,
                        const at::Tensor& dense_weight,
                        const std::optional<at::Tensor>& dense_bias,
                        int64_t shard_dim,
                        const GroupPtr& group) {
  at::NoGradGuard no_grad;
  weight.copy_(shard(dense_weight, shard_dim, group));
  if (bias && bias->defined()) {
    TORCH_CHECK(dense_bias && dense_bias->defined(), "torch_mp: the dense layer has no bias");
    bias->copy_(shard_dim == 0 ? shard(*dense_bias, 0, group) : *dense_bias);
  }
}

std::pair<at::Tensor, std::optional<at::Tensor>> gather_dense_linear(
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    int64_t shard_dim,
    const GroupPtr& group) {
  std::optional<at::Tensor> dense_bias;
  if (bias && bias->defined()) {
    dense_bias = shard_dim == 0 ? unshard(*bias, 0, group) : bias->detach().clone();
  }
  return {unshard(weight, shard_dim, group), dense_bias};
}

// ---- ColumnParallelLinear --------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options_,
                                                   bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ColumnParallelLinearImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& group = options.group();
  check_column_parallel_linear(options.in_features(),
                               options.out_features(),
                               options.bias(),
                               options.gather_output(),
                               options.sequence_parallel(),
                               group);
  const int64_t local_out = options.out_features() / group->getSize();
  weight = register_parameter("weight", at::empty({local_out, options.in_features()}));
  bias = register_parameter("bias",
                            options.bias() ? at::empty({local_out}) : at::Tensor(),
                            /*requires_grad=*/options.bias());
  set_weight_and_bias_layout(weight, bias, /*shard_dim=*/0, group);
  if (initialise_) {
    reset_parameters();
  }
}

void ColumnParallelLinearImpl::reset_parameters() {
  init_parallel_linear_(weight,
                        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                        options.in_features(),
                        options.out_features(),
                        0,
                        options.group());
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  return column_parallel_linear(input,
                                weight,
                                bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                                options.out_features(),
                                options.gather_output(),
                                options.sequence_parallel(),
                                options.group());
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "torch_mp::ColumnParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", gather_output=" << options.gather_output()
         << ", sequence_parallel=" << options.sequence_parallel()
         << ", tp_size=" << options.group()->getSize() << ")";
}

ColumnParallelLinear ColumnParallelLinearImpl::uninitialised(ColumnParallelLinearOptions options) {
  return ColumnParallelLinear(std::shared_ptr<ColumnParallelLinearImpl>(
      new ColumnParallelLinearImpl(std::move(options), /*initialise=*/false)));
}

ColumnParallelLinear ColumnParallelLinearImpl::from_dense(const torch::nn::Linear& dense,
                                                          ColumnParallelLinearOptions options) {
  const auto& dense_options = dense->options;
  TORCH_CHECK(
      dense_options.in_features() == options.in_features() &&
          dense_options.out_features() == options.out_features() &&
          dense_options.bias() == options.bias(),
      "ColumnParallelLinear.from_dense: the options must match the dense layer's in_features, "
      "out_features and bias");
  auto layer = uninitialised(std::move(options));
  load_dense_linear_(
      layer->weight, layer->bias, dense->weight, dense->bias, 0, layer->options.group());
  return layer;
}

torch::nn::Linear ColumnParallelLinearImpl::to_dense() const {
  const KeepDefaultRng keep_rng;  // the dense layer's own initialisation is overwritten
  torch::nn::Linear dense(
      torch::nn::LinearOptions(options.in_features(), options.out_features()).bias(options.bias()));
  dense->to(weight.device(), weight.scalar_type());
  const auto [dense_weight, dense_bias] = gather_dense_linear(
      weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, 0, options.group());
  at::NoGradGuard no_grad;
  dense->weight.copy_(dense_weight);
  if (dense_bias) {
    dense->bias.copy_(*dense_bias);
  }
  return dense;
}

// ---- RowParallelLinear -----------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options_, bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void RowParallelLinearImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& group = options.group();
  check_row_parallel_linear(options.in_features(),
                            options.out_features(),
                            options.bias(),
                            options.input_is_parallel(),
                            options.sequence_parallel(),
                            group);
  const int64_t local_in = options.in_features() / group->getSize();
  weight = register_parameter("weight", at::empty({options.out_features(), local_in}));
  bias = register_parameter("bias",
                            options.bias() ? at::empty({options.out_features()}) : at::Tensor(),
                            /*requires_grad=*/options.bias());
  set_weight_and_bias_layout(weight, bias, /*shard_dim=*/1, group);
  if (initialise_) {
    reset_parameters();
  }
}

void RowParallelLinearImpl::reset_parameters() {
  init_parallel_linear_(weight,
                        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                        options.in_features(),
                        options.out_features(),
                        1,
                        options.group());
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  return row_parallel_linear(input,
                             weight,
                             bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                             options.in_features(),
                             options.input_is_parallel(),
                             options.sequence_parallel(),
                             options.group());
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "torch_mp::RowParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", input_is_parallel=" << options.input_is_parallel()
         << ", sequence_parallel=" << options.sequence_parallel()
         << ", tp_size=" << options.group()->getSize() << ")";
}

RowParallelLinear RowParallelLinearImpl::uninitialised(RowParallelLinearOptions options) {
  return RowParallelLinear(std::shared_ptr<RowParallelLinearImpl>(
      new RowParallelLinearImpl(std::move(options), /*initialise=*/false)));
}

RowParallelLinear RowParallelLinearImpl::from_dense(const torch::nn::Linear& dense,
                                                    RowParallelLinearOptions options) {
  const auto& dense_options = dense->options;
  TORCH_CHECK(dense_options.in_features() == options.in_features() &&
                  dense_options.out_features() == options.out_features() &&
                  dense_options.bias() == options.bias(),
              "RowParallelLinear.from_dense: the options must match the dense layer's in_features, "
              "out_features and bias");
  auto layer = uninitialised(std::move(options));
  load_dense_linear_(
      layer->weight, layer->bias, dense->weight, dense->bias, 1, layer->options.group());
  return layer;
}

torch::nn::Linear RowParallelLinearImpl::to_dense() const {
  const KeepDefaultRng keep_rng;  // the dense layer's own initialisation is overwritten
  torch::nn::Linear dense(
      torch::nn::LinearOptions(options.in_features(), options.out_features()).bias(options.bias()));
  dense->to(weight.device(), weight.scalar_type());
  const auto [dense_weight, dense_bias] = gather_dense_linear(
      weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, 1, options.group());
  at::NoGradGuard no_grad;
  dense->weight.copy_(dense_weight);
  if (dense_bias) {
    dense->bias.copy_(*dense_bias);
  }
  return dense;
}

}  // namespace torch_mp::tensor_parallel
