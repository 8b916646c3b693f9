#include "torch_mp/tensor_parallel/mlp.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_mp/activation.h"
#include "torch_mp/collectives.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/random.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {

void check_parallel_mlp(const ParallelMLPOptions& o) {
  TORCH_CHECK(o.group(), "ParallelMLP: options.group() is not set");
  options::check_same_options(o, o.group(), "ParallelMLP");
  check_activation(o.activation());
  check_non_negative(o.hidden_size(), "ParallelMLP: hidden_size");
  divide(o.ffn_hidden_size(), o.group()->getSize(), "ParallelMLP: ffn_hidden_size");
}

at::Tensor parallel_mlp(const at::Tensor& x,
                        const MLPParameters& p,
                        const ParallelMLPOptions& o,
                        bool training) {
  const auto& group = o.group();
  TORCH_CHECK(group, "parallel_mlp: options.group() is not set");
  const auto inner = activation(
      column_parallel_linear(
          x, p.fc1_weight, p.fc1_bias, o.ffn_hidden_size(), false, o.sequence_parallel(), group),
      o.activation());
  return row_parallel_linear(region_dropout(inner, o.dropout(), training),
                             p.fc2_weight,
                             p.fc2_bias,
                             o.ffn_hidden_size(),
                             true,
                             o.sequence_parallel(),
                             group);
}

ColumnParallelLinearOptions fc1_options(const ParallelMLPOptions& o) {
  return ColumnParallelLinearOptions(o.hidden_size(), o.ffn_hidden_size())
      .bias(o.bias())
      .sequence_parallel(o.sequence_parallel())
      .group(o.group());
}

RowParallelLinearOptions fc2_options(const ParallelMLPOptions& o) {
  return RowParallelLinearOptions(o.ffn_hidden_size(), o.hidden_size())
      .bias(o.bias())
      .sequence_parallel(o.sequence_parallel())
      .group(o.group());
}

// ---- ParallelMLP ------------------------------------------------------------------------------

ParallelMLPImpl::ParallelMLPImpl(ParallelMLPOptions options_, bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelMLPImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& o = options;
  check_parallel_mlp(o);
  fc1 = register_module("fc1", ColumnParallelLinearImpl::uninitialised(fc1_options(o)));
  fc2 = register_module("fc2", RowParallelLinearImpl::uninitialised(fc2_options(o)));
  if (initialise_) {
    reset_parameters();
  }
}

void ParallelMLPImpl::reset_parameters() {
  fc1->reset_parameters();
  fc2->reset_parameters();
}

MLPParameters ParallelMLPImpl::weights() const {
  return {fc1->weight, optional_tensor(fc1->bias), fc2->weight, optional_tensor(fc2->bias)};
}

at::Tensor ParallelMLPImpl::forward(const at::Tensor& x) {
  return parallel_mlp(x, weights(), options, is_training());
}

ParallelMLP ParallelMLPImpl::uninitialised(ParallelMLPOptions options) {
  return ParallelMLP(
      std::shared_ptr<ParallelMLPImpl>(new ParallelMLPImpl(std::move(options), false)));
}

void ParallelMLPImpl::load_dense(const torch::nn::Linear& dense1, const torch::nn::Linear& dense2) {
  load_dense_linear_(fc1->weight,
                     optional_tensor(fc1->bias),
                     dense1->weight,
                     optional_tensor(dense1->bias),
                     0,
                     options.group());
  load_dense_linear_(fc2->weight,
                     optional_tensor(fc2->bias),
                     dense2->weight,
                     optional_tensor(dense2->bias),
                     1,
                     options.group());
}

ParallelMLP ParallelMLPImpl::from_dense(const torch::nn::Linear& fc1,
                                        const torch::nn::Linear& fc2,
                                        ParallelMLPOptions options) {
  const auto& a = fc1->options;
  const auto& b = fc2->options;
  TORCH_CHECK(a.out_features() == b.in_features() && a.in_features() == b.out_features() &&
                  a.bias() == b.bias(),
              "ParallelMLP.from_dense: fc1 must map h -> ffn and fc2 ffn -> h, both with or "
              "without bias");
  options.hidden_size(a.in_features()).ffn_hidden_size(a.out_features()).bias(a.bias());
  auto layer = uninitialised(std::move(options));
  layer->to(fc1->weight.device(), fc1->weight.scalar_type());
  layer->load_dense(fc1, fc2);
  return layer;
}

ParallelMLP ParallelMLPImpl::from_dense(const dense::MLP& mlp, ParallelMLPOptions options) {
  options.activation(mlp->options.activation()).dropout(mlp->options.dropout());
  return from_dense(mlp->fc1, mlp->fc2, std::move(options));
}

// ---- the operator -----------------------------------------------------------------------------

namespace {

at::Tensor parallel_mlp_op(const at::Tensor& x,
                           const at::Tensor& fc1_weight,
                           const std::optional<at::Tensor>& fc1_bias,
                           const at::Tensor& fc2_weight,
                           const std::optional<at::Tensor>& fc2_bias,
                           bool training,
                           const ParallelMLPOptions& options) {
  return parallel_mlp(x, {fc1_weight, fc1_bias, fc2_weight, fc2_bias}, options, training);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&parallel_mlp_op>(
      m,
      "parallel_mlp(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, "
      "Tensor? fc2_bias, bool training)");
}

}  // namespace torch_mp::tensor_parallel
