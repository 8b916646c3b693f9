#include "torch_mp/tensor_parallel/linear.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"
#include "torch_mp/mesh.h"
#include "torch_mp/operator_options.h"
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

void check_column_parallel_linear(const ColumnParallelLinearOptions& o) {
  TORCH_CHECK(o.group(), "ColumnParallelLinear: options.group() is not set");
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  options::check_same_options(o, o.group(), "ColumnParallelLinear");
  check_non_negative(o.in_features(), "ColumnParallelLinear: in_features");
  divide(o.out_features(), o.group()->getSize(), "ColumnParallelLinear: out_features");
  TORCH_CHECK(!(o.gather_output() && o.sequence_parallel()),
              "ColumnParallelLinear: gather_output and sequence_parallel cannot both be set "
              "(a sequence-parallel layer hands its split output to a RowParallelLinear)");
}

void check_row_parallel_linear(const RowParallelLinearOptions& o) {
  TORCH_CHECK(o.group(), "RowParallelLinear: options.group() is not set");
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  options::check_same_options(o, o.group(), "RowParallelLinear");
  divide(o.in_features(), o.group()->getSize(), "RowParallelLinear: in_features");
  check_non_negative(o.out_features(), "RowParallelLinear: out_features");
  TORCH_CHECK(o.input_is_parallel() || !o.sequence_parallel(),
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

// ---- ColumnParallelLinear and RowParallelLinear ----------------------------------------------

template <typename Options>
ParallelLinearImpl<Options>::ParallelLinearImpl(Options options_, bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

template <typename Options>
void ParallelLinearImpl<Options>::reset() {
  constexpr bool column = Options::kShardDim == 0;
  options.group(tp_group_or_default(options.group()));
  const auto& o = options;
  if constexpr (column) {
    check_column_parallel_linear(o);
  } else {
    check_row_parallel_linear(o);
  }
  const int64_t t = o.group()->getSize();
  const int64_t out = column ? o.out_features() / t : o.out_features();
  const int64_t in = column ? o.in_features() : o.in_features() / t;
  weight = this->register_parameter("weight", at::empty({out, in}));
  bias = this->register_parameter(
      "bias", o.bias() ? at::empty({out}) : at::Tensor(), /*requires_grad=*/o.bias());
  set_weight_and_bias_layout(weight, bias, Options::kShardDim, o.group());
  if (initialise_) {
    reset_parameters();
  }
}

template <typename Options>
void ParallelLinearImpl<Options>::reset_parameters() {
  init_parallel_linear_(weight,
                        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                        options.in_features(),
                        options.out_features(),
                        Options::kShardDim,
                        options.group());
}

template <typename Options>
at::Tensor ParallelLinearImpl<Options>::forward(const at::Tensor& input) {
  const auto b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  const auto& o = options;
  if constexpr (Options::kShardDim == 0) {
    return column_parallel_linear(
        input, weight, b, o.out_features(), o.flag(), o.sequence_parallel(), o.group());
  } else {
    return row_parallel_linear(
        input, weight, b, o.in_features(), o.flag(), o.sequence_parallel(), o.group());
  }
}

template <typename Options>
void ParallelLinearImpl<Options>::pretty_print(std::ostream& stream) const {
  stream << "torch_mp::" << Options::kName << "(" << options::describe(options)
         << ", tp_size=" << options.group()->getSize() << ")";
}

template <typename Options>
typename Options::Holder ParallelLinearImpl<Options>::uninitialised(Options options) {
  return typename Options::Holder(std::shared_ptr<ParallelLinearImpl>(
      new ParallelLinearImpl(std::move(options), /*initialise=*/false)));
}

template <typename Options>
typename Options::Holder ParallelLinearImpl<Options>::from_dense(const torch::nn::Linear& dense,
                                                                 Options options) {
  const auto& dense_options = dense->options;
  TORCH_CHECK(dense_options.in_features() == options.in_features() &&
                  dense_options.out_features() == options.out_features() &&
                  dense_options.bias() == options.bias(),
              Options::kName,
              ".from_dense: the options must match the dense layer's in_features, out_features "
              "and bias");
  auto layer = uninitialised(std::move(options));
  load_dense_linear_(layer->weight,
                     layer->bias,
                     dense->weight,
                     dense->bias,
                     Options::kShardDim,
                     layer->options.group());
  return layer;
}

template <typename Options>
torch::nn::Linear ParallelLinearImpl<Options>::to_dense() const {
  const KeepDefaultRng keep_rng;  // the dense layer's own initialisation is overwritten
  torch::nn::Linear dense(
      torch::nn::LinearOptions(options.in_features(), options.out_features()).bias(options.bias()));
  dense->to(weight.device(), weight.scalar_type());
  const auto [dense_weight, dense_bias] =
      gather_dense_linear(weight,
                          bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                          Options::kShardDim,
                          options.group());
  at::NoGradGuard no_grad;
  dense->weight.copy_(dense_weight);
  if (dense_bias) {
    dense->bias.copy_(*dense_bias);
  }
  return dense;
}

template class ParallelLinearImpl<ColumnParallelLinearOptions>;
template class ParallelLinearImpl<RowParallelLinearOptions>;

// ---- the operators (compositions of the collectives' operators and ATen's) ------------------

namespace {

at::Tensor column_parallel_linear_op(const at::Tensor& input,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias_tensor,
                                     const ColumnParallelLinearOptions& o) {
  check_bias_given(o, bias_tensor);
  return column_parallel_linear(input,
                                weight,
                                bias_tensor,
                                o.out_features(),
                                o.gather_output(),
                                o.sequence_parallel(),
                                o.group());
}

at::Tensor row_parallel_linear_op(const at::Tensor& input,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias_tensor,
                                  const RowParallelLinearOptions& o) {
  check_bias_given(o, bias_tensor);
  return row_parallel_linear(input,
                             weight,
                             bias_tensor,
                             o.in_features(),
                             o.input_is_parallel(),
                             o.sequence_parallel(),
                             o.group());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&column_parallel_linear_op>(
      m, "column_parallel_linear(Tensor input, Tensor weight, Tensor? bias_tensor)");
  options::def_layer_operator<&row_parallel_linear_op>(
      m, "row_parallel_linear(Tensor input, Tensor weight, Tensor? bias_tensor)");
}

}  // namespace torch_mp::tensor_parallel
