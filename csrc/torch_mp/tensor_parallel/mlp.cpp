#include "torch_mp/tensor_parallel/mlp.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_mp/activation.h"
#include "torch_mp/collectives.h"
#include "torch_mp/tensor_parallel/random.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

// The activation's id in the agreement check (-1: unknown, raised after the check).
int64_t activation_id(const std::string& name) {
  return name == "gelu" ? 0 : name == "relu" ? 1 : -1;
}

}  // namespace

void check_parallel_mlp(int64_t hidden_size,
                        int64_t ffn_hidden_size,
                        bool bias,
                        const std::string& activation_name,
                        double dropout,
                        bool sequence_parallel,
                        const GroupPtr& group) {
  comm::check_same_across_ranks({hidden_size,
                                 ffn_hidden_size,
                                 bias,
                                 activation_id(activation_name),
                                 comm::bits(dropout),
                                 sequence_parallel},
                                group,
                                "ParallelMLP configuration [hidden_size, ffn_hidden_size, bias, "
                                "activation (0 gelu, 1 relu), dropout (bits), sequence_parallel]");
  check_activation(activation_name);
  check_non_negative(hidden_size, "ParallelMLP: hidden_size");
  divide(ffn_hidden_size, group->getSize(), "ParallelMLP: ffn_hidden_size");
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

// ---- ParallelMLP ------------------------------------------------------------------------------

ParallelMLPImpl::ParallelMLPImpl(ParallelMLPOptions options_, bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelMLPImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& o = options;
  check_parallel_mlp(o.hidden_size(),
                     o.ffn_hidden_size(),
                     o.bias(),
                     o.activation(),
                     o.dropout(),
                     o.sequence_parallel(),
                     o.group());
  fc1 = register_module("fc1",
                        ColumnParallelLinearImpl::uninitialised(
                            ColumnParallelLinearOptions(o.hidden_size(), o.ffn_hidden_size())
                                .bias(o.bias())
                                .sequence_parallel(o.sequence_parallel())
                                .group(o.group())));
  fc2 = register_module("fc2",
                        RowParallelLinearImpl::uninitialised(
                            RowParallelLinearOptions(o.ffn_hidden_size(), o.hidden_size())
                                .bias(o.bias())
                                .sequence_parallel(o.sequence_parallel())
                                .group(o.group())));
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
                           c10::string_view activation,
                           double dropout,
                           bool sequence_parallel,
                           bool training,
                           c10::string_view group_name) {
  const auto group = group_named(group_name);
  const auto options = ParallelMLPOptions(fc1_weight.size(1), fc1_weight.size(0) * group->getSize())
                           .bias(fc1_bias.has_value())
                           .activation(std::string(activation))
                           .dropout(dropout)
                           .sequence_parallel(sequence_parallel)
                           .group(group);
  return parallel_mlp(x, {fc1_weight, fc1_bias, fc2_weight, fc2_bias}, options, training);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def(
      "parallel_mlp(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, "
      "Tensor? fc2_bias, str activation, float dropout, bool sequence_parallel, bool training, "
      "str group) -> Tensor",
      &parallel_mlp_op);
}

}  // namespace torch_mp::tensor_parallel
