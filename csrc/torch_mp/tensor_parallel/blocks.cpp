#include "torch_mp/tensor_parallel/blocks.h"

#include <ATen/ATen.h>

#include <bit>
#include <limits>
#include <variant>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"
#include "torch_mp/tensor_parallel/random.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A double as the int64 of its bits, for the cross-rank agreement checks.
int64_t bits(double value) { return std::bit_cast<int64_t>(value); }

// The activation's id in the agreement checks (-1: unknown, raised after the check).
int64_t activation_id(const std::string& name) {
  return name == "gelu" ? 0 : name == "relu" ? 1 : -1;
}

std::string activation_name(const torch::nn::activation_t& a) {
  if (std::holds_alternative<torch::enumtype::kReLU>(a)) {
    return "relu";
  }
  TORCH_CHECK(std::holds_alternative<torch::enumtype::kGELU>(a),
              "ParallelTransformerLayer.from_dense: only relu and gelu activations are supported");
  return "gelu";
}

}  // namespace

// ---- functions --------------------------------------------------------------------------------

at::Tensor region_dropout(const at::Tensor& x, double p, bool training) {
  if (!training || p == 0.0) {
    return x;
  }
  const c10::Device device = x.device();
  if (!rng_tracker().has(kModelParallelRng, device)) {
    return at::dropout(x, p, /*train=*/true);
  }
  const auto fork = rng_tracker().fork(kModelParallelRng, device);
  return at::dropout(x, p, /*train=*/true);
}

at::Tensor layer_norm(const at::Tensor& input,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias,
                      double eps,
                      bool sequence_parallel,
                      const GroupPtr& group) {
  auto enter = [&](const std::optional<at::Tensor>& p) -> std::optional<at::Tensor> {
    if (!p || !p->defined()) {
      return std::nullopt;
    }
    return sequence_parallel ? copy_to_tp(*p, group) : *p;
  };
  return at::layer_norm(input, {input.size(-1)}, enter(weight), enter(bias), eps);
}

at::Tensor attention_heads(const at::Tensor& qkv,
                           int64_t num_heads,
                           const GroupPtr& group,
                           const std::optional<at::Tensor>& attn_mask,
                           bool is_causal,
                           double dropout_p) {
  const int64_t heads_local = num_heads / group->getSize();
  TORCH_CHECK(qkv.dim() == 3 && heads_local > 0 && qkv.size(2) % (3 * heads_local) == 0,
              "attention_heads: qkv must be [s, b, 3 * heads * head_dim], got ",
              qkv.sizes(),
              " for ",
              heads_local,
              " heads");
  const int64_t s = qkv.size(0);
  const int64_t b = qkv.size(1);
  const int64_t width = qkv.size(2) / 3;
  const int64_t head_dim = width / heads_local;
  // [s, b, heads * d] -> [b, heads, s, d], the layout torch::nn::MultiheadAttention uses.
  auto heads = [&](const at::Tensor& t) {
    return t.reshape({s, b, heads_local, head_dim}).permute({1, 2, 0, 3});
  };
  const auto parts = qkv.chunk(3, -1);
  std::optional<at::Tensor> mask;
  if (attn_mask && attn_mask->defined()) {
    mask = *attn_mask;
    // The same shape test on every rank (a rank-dependent one would leave the others waiting).
    const bool per_head = mask->dim() == 3 && mask->size(0) == b * num_heads &&
                          mask->size(1) == s && mask->size(2) == s;
    TORCH_CHECK(per_head || (mask->dim() == 2 && mask->size(0) == s && mask->size(1) == s),
                "attention_heads: attn_mask must be [s, s] or [batch * num_heads, s, s] = [",
                b * num_heads,
                ", ",
                s,
                ", ",
                s,
                "], got ",
                mask->sizes());
    if (per_head) {  // this rank's heads only
      mask = mask->reshape({b, num_heads, s, s})
                 .narrow(1, group->getRank() * heads_local, heads_local);
    }
    if (mask->scalar_type() == at::kBool) {  // true = may not attend, as in MultiheadAttention
      mask = at::zeros(mask->sizes(), qkv.options())
                 .masked_fill_(*mask, -std::numeric_limits<double>::infinity());
    }
  }
  const bool causal = is_causal && !mask;
  at::Tensor context;
  {
    std::optional<RngTracker::Fork> fork;
    if (dropout_p > 0 && rng_tracker().has(kModelParallelRng, qkv.device())) {
      fork.emplace(rng_tracker(), kModelParallelRng, qkv.device());
    }
    context = at::scaled_dot_product_attention(
        heads(parts[0]), heads(parts[1]), heads(parts[2]), mask, dropout_p, causal);
  }
  return context.permute({2, 0, 1, 3}).reshape({s, b, width});
}

void check_parallel_self_attention(int64_t hidden_size,
                                   int64_t num_heads,
                                   bool bias,
                                   double dropout,
                                   bool sequence_parallel,
                                   const GroupPtr& group) {
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  comm::check_same_across_ranks(
      {hidden_size, num_heads, bias, bits(dropout), sequence_parallel},
      group,
      "ParallelSelfAttention configuration [hidden_size, num_heads, bias, dropout (bits), "
      "sequence_parallel]");
  check_non_negative(hidden_size, "ParallelSelfAttention: hidden_size");
  TORCH_CHECK(num_heads > 0 && hidden_size % num_heads == 0,
              "ParallelSelfAttention: hidden_size (",
              hidden_size,
              ") must be divisible by num_heads (",
              num_heads,
              ")");
  divide(num_heads, group->getSize(), "ParallelSelfAttention: num_heads");
}

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
                                 bits(dropout),
                                 sequence_parallel},
                                group,
                                "ParallelMLP configuration [hidden_size, ffn_hidden_size, bias, "
                                "activation (0 gelu, 1 relu), dropout (bits), sequence_parallel]");
  activation(at::zeros({1}), activation_name);  // raises on an unknown name
  check_non_negative(hidden_size, "ParallelMLP: hidden_size");
  divide(ffn_hidden_size, group->getSize(), "ParallelMLP: ffn_hidden_size");
}

void check_parallel_transformer_layer(bool norm_first,
                                      double layer_norm_eps,
                                      const GroupPtr& group) {
  comm::check_same_across_ranks(
      {norm_first, bits(layer_norm_eps)},
      group,
      "ParallelTransformerLayer configuration [norm_first, layer_norm_eps (bits)]");
}

void check_parallel_conv_block(int64_t in_channels,
                               int64_t mid_channels,
                               int64_t out_channels,
                               int64_t kernel_size,
                               int64_t padding,
                               bool bias,
                               const GroupPtr& group) {
  comm::check_same_across_ranks(
      {in_channels, mid_channels, out_channels, kernel_size, padding, bias},
      group,
      "ParallelConvBlock configuration [in_channels, mid_channels, out_channels, kernel_size, "
      "padding, bias]");
  TORCH_CHECK(
      in_channels > 0 && mid_channels > 0 && out_channels > 0 && kernel_size > 0 && padding >= 0,
      "ParallelConvBlock: channels and kernel_size must be positive and padding "
      "non-negative, got in_channels=",
      in_channels,
      ", mid_channels=",
      mid_channels,
      ", out_channels=",
      out_channels,
      ", kernel_size=",
      kernel_size,
      ", padding=",
      padding);
  divide(mid_channels, group->getSize(), "ParallelConvBlock: mid_channels");
}

void load_dense_qkv_(at::Tensor& weight,
                     std::optional<at::Tensor> bias,
                     const at::Tensor& dense_weight,
                     const std::optional<at::Tensor>& dense_bias,
                     const GroupPtr& group) {
  at::NoGradGuard no_grad;
  const int64_t h = dense_weight.size(0) / 3;
  // Q, K and V each give up their rows [r * h / t, (r + 1) * h / t).
  weight.copy_(shard(dense_weight.view({3, h, -1}), 1, group).view_as(weight));
  if (bias && bias->defined()) {
    TORCH_CHECK(dense_bias && dense_bias->defined(), "torch_mp: the dense attention has no bias");
    bias->copy_(shard(dense_bias->view({3, h}), 1, group).view_as(*bias));
  }
}

std::pair<at::Tensor, std::optional<at::Tensor>> gather_dense_qkv(
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const GroupPtr& group) {
  const int64_t local = weight.size(0) / 3;
  auto dense_weight = unshard(weight.view({3, local, -1}), 1, group).view({-1, weight.size(1)});
  std::optional<at::Tensor> dense_bias;
  if (bias && bias->defined()) {
    dense_bias = unshard(bias->view({3, local}), 1, group).view({-1});
  }
  return {dense_weight, dense_bias};
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

// ---- ParallelSelfAttention --------------------------------------------------------------------

ParallelSelfAttentionImpl::ParallelSelfAttentionImpl(ParallelSelfAttentionOptions options_,
                                                     bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelSelfAttentionImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& o = options;
  check_parallel_self_attention(
      o.hidden_size(), o.num_heads(), o.bias(), o.dropout(), o.sequence_parallel(), o.group());
  qkv = register_module("qkv",
                        ColumnParallelLinearImpl::uninitialised(
                            ColumnParallelLinearOptions(o.hidden_size(), 3 * o.hidden_size())
                                .bias(o.bias())
                                .sequence_parallel(o.sequence_parallel())
                                .group(o.group())));
  proj = register_module("proj",
                         RowParallelLinearImpl::uninitialised(
                             RowParallelLinearOptions(o.hidden_size(), o.hidden_size())
                                 .bias(o.bias())
                                 .sequence_parallel(o.sequence_parallel())
                                 .group(o.group())));
  register_layouts();
  if (initialise_) {
    reset_parameters();
  }
}

void ParallelSelfAttentionImpl::reset_parameters() {
  load_dense(torch::nn::MultiheadAttention(
      torch::nn::MultiheadAttentionOptions(options.hidden_size(), options.num_heads())
          .bias(options.bias())));
}

void ParallelSelfAttentionImpl::load_dense(const torch::nn::MultiheadAttention& dense) {
  load_dense_qkv_(qkv->weight,
                  optional(qkv->bias),
                  dense->in_proj_weight,
                  optional(dense->in_proj_bias),
                  options.group());
  load_dense_linear_(proj->weight,
                     optional(proj->bias),
                     dense->out_proj->weight,
                     optional(dense->out_proj->bias),
                     1,
                     options.group());
}

at::Tensor ParallelSelfAttentionImpl::forward(const at::Tensor& x,
                                              const at::Tensor& attn_mask,
                                              bool is_causal) {
  const auto context = attention_heads(qkv(x),
                                       options.num_heads(),
                                       options.group(),
                                       optional(attn_mask),
                                       is_causal,
                                       is_training() ? options.dropout() : 0.0);
  return proj(context);
}

void ParallelSelfAttentionImpl::register_layouts() {
  for (const auto& p : qkv->parameters()) {  // this rank's rows of Q, of K and of V
    set_layout(p, ParameterLayout{0, options.group(), false, /*parts=*/3});
  }
}

std::shared_ptr<torch::nn::Module> ParallelSelfAttentionImpl::clone(
    const std::optional<torch::Device>& device) const {
  auto copy = Cloneable::clone(device);
  std::dynamic_pointer_cast<ParallelSelfAttentionImpl>(copy)->register_layouts();
  return copy;
}

const DenseNames& ParallelSelfAttentionImpl::dense_names() {
  static const DenseNames names{{"qkv.", "in_proj_"}, {"proj.", "out_proj."}};
  return names;
}

ParallelSelfAttention ParallelSelfAttentionImpl::uninitialised(
    ParallelSelfAttentionOptions options) {
  return ParallelSelfAttention(std::shared_ptr<ParallelSelfAttentionImpl>(
      new ParallelSelfAttentionImpl(std::move(options), /*initialise=*/false)));
}

ParallelSelfAttention ParallelSelfAttentionImpl::from_dense(
    const torch::nn::MultiheadAttention& dense, ParallelSelfAttentionOptions options) {
  const auto& d = dense->options;
  TORCH_CHECK(d.kdim() == d.embed_dim() && d.vdim() == d.embed_dim() && !d.add_bias_kv() &&
                  !d.add_zero_attn(),
              "ParallelSelfAttention.from_dense: kdim/vdim, add_bias_kv and add_zero_attn are "
              "not supported");
  options.hidden_size(d.embed_dim()).num_heads(d.num_heads()).bias(d.bias()).dropout(d.dropout());
  auto layer = uninitialised(std::move(options));
  layer->to(dense->in_proj_weight.device(), dense->in_proj_weight.scalar_type());
  layer->load_dense(dense);
  return layer;
}

torch::nn::MultiheadAttention ParallelSelfAttentionImpl::to_dense() const {
  const auto [in_weight, in_bias] =
      gather_dense_qkv(qkv->weight, optional(qkv->bias), options.group());
  const auto [out_weight, out_bias] =
      gather_dense_linear(proj->weight, optional(proj->bias), 1, options.group());
  const KeepDefaultRng keep_rng;  // the dense module's own initialisation is overwritten
  torch::nn::MultiheadAttention dense(
      torch::nn::MultiheadAttentionOptions(options.hidden_size(), options.num_heads())
          .bias(options.bias())
          .dropout(options.dropout()));
  dense->to(in_weight.device(), in_weight.scalar_type());
  at::NoGradGuard no_grad;
  dense->in_proj_weight.copy_(in_weight);
  dense->out_proj->weight.copy_(out_weight);
  if (in_bias) {
    dense->in_proj_bias.copy_(*in_bias);
    dense->out_proj->bias.copy_(*out_bias);
  }
  return dense;
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

at::Tensor ParallelMLPImpl::forward(const at::Tensor& x) {
  const auto inner = activation(fc1(x), options.activation());
  return fc2(region_dropout(inner, options.dropout(), is_training()));
}

ParallelMLP ParallelMLPImpl::uninitialised(ParallelMLPOptions options) {
  return ParallelMLP(
      std::shared_ptr<ParallelMLPImpl>(new ParallelMLPImpl(std::move(options), false)));
}

void ParallelMLPImpl::load_dense(const torch::nn::Linear& dense1, const torch::nn::Linear& dense2) {
  load_dense_linear_(
      fc1->weight, optional(fc1->bias), dense1->weight, optional(dense1->bias), 0, options.group());
  load_dense_linear_(
      fc2->weight, optional(fc2->bias), dense2->weight, optional(dense2->bias), 1, options.group());
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

// ---- ParallelTransformerLayer -----------------------------------------------------------------

ParallelTransformerLayerImpl::ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options_,
                                                           bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelTransformerLayerImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto& o = options;
  // What the attention and MLP do not check themselves.
  check_parallel_transformer_layer(o.norm_first(), o.layer_norm_eps(), o.group());
  const auto norm_options = torch::nn::LayerNormOptions({o.hidden_size()}).eps(o.layer_norm_eps());
  norm1 = register_module("norm1", torch::nn::LayerNorm(norm_options));
  self_attn = register_module("self_attn",
                              ParallelSelfAttentionImpl::uninitialised(
                                  ParallelSelfAttentionOptions(o.hidden_size(), o.num_heads())
                                      .bias(o.bias())
                                      .dropout(o.dropout())
                                      .sequence_parallel(o.sequence_parallel())
                                      .group(o.group())));
  norm2 = register_module("norm2", torch::nn::LayerNorm(norm_options));
  mlp = register_module(
      "mlp",
      ParallelMLPImpl::uninitialised(ParallelMLPOptions(o.hidden_size(), o.ffn_hidden_size())
                                         .bias(o.bias())
                                         .activation(o.activation())
                                         .dropout(o.dropout())
                                         .sequence_parallel(o.sequence_parallel())
                                         .group(o.group())));
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
  load_dense(torch::nn::TransformerEncoderLayer(
      torch::nn::TransformerEncoderLayerOptions(o.hidden_size(), o.num_heads())
          .dim_feedforward(o.ffn_hidden_size())));
}

const DenseNames& ParallelTransformerLayerImpl::dense_names() {
  static const DenseNames names{{"self_attn.qkv.", "self_attn.in_proj_"},
                                {"self_attn.proj.", "self_attn.out_proj."},
                                {"mlp.fc1.", "linear1."},
                                {"mlp.fc2.", "linear2."}};
  return names;
}

void ParallelTransformerLayerImpl::load_dense(const torch::nn::TransformerEncoderLayer& dense) {
  self_attn->load_dense(dense->self_attn);
  mlp->load_dense(dense->linear1, dense->linear2);
  at::NoGradGuard no_grad;
  norm1->weight.copy_(dense->norm1->weight);
  norm1->bias.copy_(dense->norm1->bias);
  norm2->weight.copy_(dense->norm2->weight);
  norm2->bias.copy_(dense->norm2->bias);
}

at::Tensor ParallelTransformerLayerImpl::norm(const torch::nn::LayerNorm& layer,
                                              const at::Tensor& x) {
  return layer_norm(x,
                    optional(layer->weight),
                    optional(layer->bias),
                    options.layer_norm_eps(),
                    options.sequence_parallel(),
                    options.group());
}

at::Tensor ParallelTransformerLayerImpl::dropout(const at::Tensor& x) {
  // Whole tensors (the same on every rank) draw from the shared stream; sequence-parallel rows
  // differ between ranks and draw from the per-rank one.
  if (options.sequence_parallel()) {
    return region_dropout(x, options.dropout(), is_training());
  }
  return at::dropout(x, options.dropout(), is_training());
}

at::Tensor ParallelTransformerLayerImpl::forward(const at::Tensor& x,
                                                 const at::Tensor& attn_mask,
                                                 bool is_causal) {
  if (options.norm_first()) {
    const auto y = x + dropout(self_attn(norm(norm1, x), attn_mask, is_causal));
    return y + dropout(mlp(norm(norm2, y)));
  }
  const auto y = norm(norm1, x + dropout(self_attn(x, attn_mask, is_causal)));
  return norm(norm2, y + dropout(mlp(y)));
}

ParallelTransformerLayer ParallelTransformerLayerImpl::from_dense(
    const torch::nn::TransformerEncoderLayer& dense, GroupPtr group, bool sequence_parallel) {
  const auto& d = dense->options;
  auto options = ParallelTransformerLayerOptions(d.d_model(), d.nhead(), d.dim_feedforward())
                     .dropout(d.dropout())
                     .activation(activation_name(d.activation()))
                     .layer_norm_eps(dense->norm1->options.eps())
                     .sequence_parallel(sequence_parallel)
                     .group(std::move(group));
  auto layer = ParallelTransformerLayer(std::shared_ptr<ParallelTransformerLayerImpl>(
      new ParallelTransformerLayerImpl(std::move(options), /*initialise=*/false)));
  layer->to(dense->linear1->weight.device(), dense->linear1->weight.scalar_type());
  layer->load_dense(dense);
  return layer;
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
  const int64_t padding = o.padding().value_or(o.kernel_size() / 2);
  check_parallel_conv_block(o.in_channels(),
                            o.mid_channels(),
                            o.out_channels(),
                            o.kernel_size(),
                            padding,
                            o.bias(),
                            o.group());
  auto conv1_options =
      ColumnParallelConv2dOptions(o.in_channels(), o.mid_channels(), o.kernel_size())
          .group(o.group());
  conv1_options.conv().padding(padding).bias(o.bias());
  auto conv2_options = RowParallelConv2dOptions(o.mid_channels(), o.out_channels(), o.kernel_size())
                           .group(o.group());
  conv2_options.conv().padding(padding).bias(o.bias());
  conv1 = register_module("conv1", ColumnParallelConv2dImpl::uninitialised(conv1_options));
  norm = register_module("norm", torch::nn::BatchNorm2d(o.mid_channels() / o.group()->getSize()));
  conv2 = register_module("conv2", RowParallelConv2dImpl::uninitialised(conv2_options));
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
                     optional(block->conv1->bias),
                     dense1->weight,
                     optional(dense1->bias),
                     0,
                     g);
  load_dense_linear_(block->conv2->weight,
                     optional(block->conv2->bias),
                     dense2->weight,
                     optional(dense2->bias),
                     1,
                     g);
  load_dense_batch_norm_(block->norm, dense_norm, g);
  return block;
}

ParallelConvBlock ParallelConvBlockImpl::from_dense(const dense::ConvBlock& block, GroupPtr group) {
  return from_dense(block->conv1, block->norm, block->conv2, std::move(group));
}

}  // namespace torch_mp::tensor_parallel
