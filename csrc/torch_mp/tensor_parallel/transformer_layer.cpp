#include "torch_mp/tensor_parallel/transformer_layer.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <variant>
#include <vector>

#include "torch_mp/collectives.h"
#include "torch_mp/context_parallel/sharding.h"
#include "torch_mp/layout.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/random.h"
#include "torch_mp/recompute.h"
#include "torch_mp/tensor_parallel/layer_norm.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

std::string activation_name(const torch::nn::activation_t& a) {
  if (std::holds_alternative<torch::enumtype::kReLU>(a)) {
    return "relu";
  }
  TORCH_CHECK(std::holds_alternative<torch::enumtype::kGELU>(a),
              "ParallelTransformerLayer.from_dense: only relu and gelu activations are supported");
  return "gelu";
}

}  // namespace

void check_parallel_transformer_layer(const ParallelTransformerLayerOptions& o) {
  TORCH_CHECK(o.group(), "ParallelTransformerLayer: options.group() is not set");
  // Agreed before it is refused: a rank that refused alone would leave the others waiting.
  options::check_same_options(o, o.group(), "ParallelTransformerLayer");
  const std::vector<std::string> modes{"", "full", "selective"};
  TORCH_CHECK(std::find(modes.begin(), modes.end(), o.recompute()) != modes.end(),
              "ParallelTransformerLayer: recompute must be none (\"\"), \"full\" or "
              "\"selective\", got \"",
              o.recompute(),
              "\"");
}

ParallelSelfAttentionOptions attention_options(const ParallelTransformerLayerOptions& o) {
  return ParallelSelfAttentionOptions(o.hidden_size(), o.num_heads())
      .bias(o.bias())
      .dropout(o.dropout())
      .sequence_parallel(o.sequence_parallel())
      .recompute_core(o.recompute() == "selective")
      .group(o.group())
      .context_parallel(o.context_parallel())
      .context_group(o.context_group())
      .context_method(o.context_method())
      .load_balance(o.load_balance())
      .softmax_scale(o.softmax_scale());
}

ParallelMLPOptions mlp_options(const ParallelTransformerLayerOptions& o) {
  return ParallelMLPOptions(o.hidden_size(), o.ffn_hidden_size())
      .bias(o.bias())
      .activation(o.activation())
      .dropout(o.dropout())
      .sequence_parallel(o.sequence_parallel())
      .group(o.group());
}

LayerNormOptions norm_options(const ParallelTransformerLayerOptions& o) {
  return LayerNormOptions({o.hidden_size()})
      .eps(o.layer_norm_eps())
      .bias(o.bias())
      .sequence_parallel(o.sequence_parallel())
      .group(o.group());
}

namespace {

at::Tensor layer_forward(const at::Tensor& x,
                         const TransformerLayerParameters& p,
                         const ParallelTransformerLayerOptions& o,
                         const std::optional<at::Tensor>& attn_mask,
                         bool is_causal,
                         bool training) {
  const auto norm = [&](const at::Tensor& t,
                        const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias) {
    return layer_norm(t, weight, bias, o.layer_norm_eps(), o.sequence_parallel(), o.group());
  };
  // Whole tensors (the same on every rank) draw from the shared stream; sequence-parallel rows
  // differ between ranks and draw from the per-rank one.
  const auto dropout = [&](const at::Tensor& t) {
    return o.sequence_parallel() ? region_dropout(t, o.dropout(), training)
                                 : at::dropout(t, o.dropout(), training);
  };
  const auto attention_options_ = attention_options(o);
  const auto attention = [&](const at::Tensor& t) {
    return parallel_self_attention(
        t, p.attention, attention_options_, attn_mask, is_causal, training);
  };
  const auto mlp_options_ = mlp_options(o);
  const auto mlp = [&](const at::Tensor& t) {
    return parallel_mlp(t, p.mlp, mlp_options_, training);
  };
  if (o.norm_first()) {
    const auto y = x + dropout(attention(norm(x, p.norm1_weight, p.norm1_bias)));
    return y + dropout(mlp(norm(y, p.norm2_weight, p.norm2_bias)));
  }
  const auto y = norm(x + dropout(attention(x)), p.norm1_weight, p.norm1_bias);
  return norm(y + dropout(mlp(y)), p.norm2_weight, p.norm2_bias);
}

// Calls f on each parameter of `p` (an at::Tensor& or a std::optional<at::Tensor>&), in order.
template <typename F>
void for_each_parameter(TransformerLayerParameters& p, F&& f) {
  f(p.norm1_weight);
  f(p.norm1_bias);
  f(p.attention.qkv_weight);
  f(p.attention.qkv_bias);
  f(p.attention.proj_weight);
  f(p.attention.proj_bias);
  f(p.norm2_weight);
  f(p.norm2_bias);
  f(p.mlp.fc1_weight);
  f(p.mlp.fc1_bias);
  f(p.mlp.fc2_weight);
  f(p.mlp.fc2_bias);
}

bool present(const at::Tensor& t) { return t.defined(); }
bool present(const std::optional<at::Tensor>& t) { return t && t->defined(); }
const at::Tensor& value(const at::Tensor& t) { return t; }
const at::Tensor& value(const std::optional<at::Tensor>& t) { return *t; }

}  // namespace

at::Tensor parallel_transformer_layer(const at::Tensor& x,
                                      const TransformerLayerParameters& p,
                                      const ParallelTransformerLayerOptions& o,
                                      const std::optional<at::Tensor>& attn_mask,
                                      bool is_causal,
                                      bool training) {
  TORCH_CHECK(o.group(), "parallel_transformer_layer: options.group() is not set");
  TORCH_CHECK(!o.context_parallel() || !training || o.dropout() == 0.0,
              "ParallelTransformerLayer: dropout (p = ",
              o.dropout(),
              ") under context parallelism is not supported in training: the ranks' masks "
              "could not be those one process draws for the whole sequence; use dropout=0");
  if (o.recompute() != "full") {
    return layer_forward(x, p, o, attn_mask, is_causal, training);
  }
  TORCH_CHECK(!attn_mask || !attn_mask->defined() || !attn_mask->requires_grad(),
              "ParallelTransformerLayer: recompute=\"full\" cannot recompute over a mask that "
              "requires grad (pass it detached)");
  // The input and the parameters go in as recompute()'s inputs, so that their gradients, the
  // parameters' too, leave its node (and the zero-bubble split finds them there).
  std::vector<at::Tensor> inputs{x};
  auto parameters = p;
  for_each_parameter(parameters, [&](auto& t) {
    if (present(t)) {
      inputs.push_back(value(t));
    }
  });
  const auto layer = [=](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    auto q = parameters;
    size_t next = 1;
    for_each_parameter(q, [&](auto& t) {
      if (present(t)) {
        t = in[next++];
      }
    });
    return {layer_forward(in[0], q, o, attn_mask, is_causal, training)};
  };
  return recompute(layer, inputs)[0];
}

// ---- ParallelTransformerLayer -----------------------------------------------------------------

ParallelTransformerLayerImpl::ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options_,
                                                           bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelTransformerLayerImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  if (options.context_parallel()) {
    options.context_group(context_parallel::cp_group_or_default(options.context_group()));
  }
  const auto& o = options;
  // What the attention and MLP do not check themselves.
  check_parallel_transformer_layer(o);
  const auto norm = norm_options(o);
  const auto dense_norm =
      dense::LayerNormOptions(norm.normalized_shape()[0]).eps(norm.eps()).bias(norm.bias());
  norm1 = register_module("norm1", dense::LayerNorm(dense_norm));
  self_attn =
      register_module("self_attn", ParallelSelfAttentionImpl::uninitialised(attention_options(o)));
  norm2 = register_module("norm2", dense::LayerNorm(dense_norm));
  mlp = register_module("mlp", ParallelMLPImpl::uninitialised(mlp_options(o)));
  for (const auto& p : norm1->parameters()) {
    set_replicated(p, o.group());
  }
  for (const auto& p : norm2->parameters()) {
    set_replicated(p, o.group());
  }
  if (initialise_) {
    reset_parameters();
  }
}

void ParallelTransformerLayerImpl::reset_parameters() {
  const auto& o = options;
  load_dense(dense::TransformerLayer(
      dense::TransformerLayerOptions(o.hidden_size(), o.num_heads(), o.ffn_hidden_size())
          .bias(o.bias())));
}

const DenseNames& ParallelTransformerLayerImpl::dense_names() {
  static const DenseNames names{{"self_attn.qkv.", "self_attn.in_proj_"},
                                {"self_attn.proj.", "self_attn.out_proj."},
                                {"mlp.fc1.", "linear1."},
                                {"mlp.fc2.", "linear2."}};
  return names;
}

namespace {

void load_norm(const dense::LayerNorm& norm, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(norm->bias.defined() == bias.defined(),
              "ParallelTransformerLayer.load_dense: the layer's LayerNorms ",
              norm->bias.defined() ? "have" : "have no",
              " bias, the dense layer's ",
              bias.defined() ? "have" : "have none");
  at::NoGradGuard no_grad;
  norm->weight.copy_(weight);
  if (bias.defined()) {
    norm->bias.copy_(bias);
  }
}

// dense::TransformerLayer and torch::nn::TransformerEncoderLayer name their parts alike.
template <typename DenseLayer>
void load_layer(ParallelTransformerLayerImpl& layer, const DenseLayer& dense) {
  layer.self_attn->load_dense(dense->self_attn);
  layer.mlp->load_dense(dense->linear1, dense->linear2);
  load_norm(layer.norm1, dense->norm1->weight, dense->norm1->bias);
  load_norm(layer.norm2, dense->norm2->weight, dense->norm2->bias);
}

template <typename DenseLayer>
ParallelTransformerLayer shard_layer(ParallelTransformerLayerOptions options,
                                     const DenseLayer& dense) {
  auto layer = ParallelTransformerLayerImpl::uninitialised(std::move(options));
  layer->to(dense->linear1->weight.device(), dense->linear1->weight.scalar_type());
  load_layer(*layer, dense);
  return layer;
}

}  // namespace

void ParallelTransformerLayerImpl::load_dense(const dense::TransformerLayer& dense) {
  load_layer(*this, dense);
}

void ParallelTransformerLayerImpl::load_dense(const torch::nn::TransformerEncoderLayer& dense) {
  load_layer(*this, dense);
}

TransformerLayerParameters ParallelTransformerLayerImpl::weights() const {
  return {optional_tensor(norm1->weight),
          optional_tensor(norm1->bias),
          self_attn->weights(),
          optional_tensor(norm2->weight),
          optional_tensor(norm2->bias),
          mlp->weights()};
}

at::Tensor ParallelTransformerLayerImpl::forward(const at::Tensor& x,
                                                 const at::Tensor& attn_mask,
                                                 bool is_causal) {
  return parallel_transformer_layer(
      x, weights(), options, optional_tensor(attn_mask), is_causal, is_training());
}

ParallelTransformerLayer ParallelTransformerLayerImpl::uninitialised(
    ParallelTransformerLayerOptions options) {
  return ParallelTransformerLayer(std::shared_ptr<ParallelTransformerLayerImpl>(
      new ParallelTransformerLayerImpl(std::move(options), /*initialise=*/false)));
}

ParallelTransformerLayer ParallelTransformerLayerImpl::from_dense(
    const dense::TransformerLayer& dense, ParallelTransformerLayerOptions options) {
  const auto& d = dense->options;
  options.hidden_size(d.hidden_size())
      .num_heads(d.num_heads())
      .ffn_hidden_size(d.ffn_hidden_size())
      .dropout(d.dropout())
      .activation(d.activation())
      .layer_norm_eps(d.layer_norm_eps())
      .norm_first(d.norm_first())
      .bias(d.bias());
  return shard_layer(std::move(options), dense);
}

ParallelTransformerLayer ParallelTransformerLayerImpl::from_dense(
    const dense::TransformerLayer& dense,
    GroupPtr group,
    bool sequence_parallel,
    std::string recompute,
    bool context_parallel) {
  const auto& d = dense->options;
  return from_dense(
      dense,
      ParallelTransformerLayerOptions(d.hidden_size(), d.num_heads(), d.ffn_hidden_size())
          .sequence_parallel(sequence_parallel)
          .recompute(std::move(recompute))
          .group(std::move(group))
          .context_parallel(context_parallel));
}

ParallelTransformerLayer ParallelTransformerLayerImpl::from_dense(
    const torch::nn::TransformerEncoderLayer& dense,
    GroupPtr group,
    bool sequence_parallel,
    std::string recompute,
    bool context_parallel) {
  const auto& d = dense->options;
  return shard_layer(ParallelTransformerLayerOptions(d.d_model(), d.nhead(), d.dim_feedforward())
                         .dropout(d.dropout())
                         .activation(activation_name(d.activation()))
                         .layer_norm_eps(dense->norm1->options.eps())
                         .sequence_parallel(sequence_parallel)
                         .recompute(std::move(recompute))
                         .group(std::move(group))
                         .context_parallel(context_parallel),
                     dense);
}

// ---- the operator -----------------------------------------------------------------------------

namespace {

using Optional = const std::optional<at::Tensor>&;

at::Tensor parallel_transformer_layer_op(const at::Tensor& x,
                                         Optional norm1_weight,
                                         Optional norm1_bias,
                                         const at::Tensor& qkv_weight,
                                         Optional qkv_bias,
                                         const at::Tensor& proj_weight,
                                         Optional proj_bias,
                                         Optional norm2_weight,
                                         Optional norm2_bias,
                                         const at::Tensor& fc1_weight,
                                         Optional fc1_bias,
                                         const at::Tensor& fc2_weight,
                                         Optional fc2_bias,
                                         Optional attn_mask,
                                         bool is_causal,
                                         bool training,
                                         const ParallelTransformerLayerOptions& options) {
  const TransformerLayerParameters parameters{norm1_weight,
                                              norm1_bias,
                                              {qkv_weight, qkv_bias, proj_weight, proj_bias},
                                              norm2_weight,
                                              norm2_bias,
                                              {fc1_weight, fc1_bias, fc2_weight, fc2_bias}};
  return parallel_transformer_layer(x, parameters, options, attn_mask, is_causal, training);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&parallel_transformer_layer_op>(
      m,
      "parallel_transformer_layer(Tensor x, Tensor? norm1_weight, Tensor? norm1_bias, "
      "Tensor qkv_weight, Tensor? qkv_bias, Tensor proj_weight, Tensor? proj_bias, "
      "Tensor? norm2_weight, Tensor? norm2_bias, Tensor fc1_weight, Tensor? fc1_bias, "
      "Tensor fc2_weight, Tensor? fc2_bias, Tensor? attn_mask, bool is_causal, bool training)");
}

}  // namespace torch_mp::tensor_parallel
