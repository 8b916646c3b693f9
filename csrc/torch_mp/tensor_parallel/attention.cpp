#include "torch_mp/tensor_parallel/attention.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "torch_mp/collectives.h"
#include "torch_mp/context_parallel/attention.h"
#include "torch_mp/context_parallel/sharding.h"
#include "torch_mp/layout.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/random.h"
#include "torch_mp/recompute.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// softmax(q k^T scale + mask) v (scale 1 / sqrt(d) when unset) with region_dropout on the
// probabilities: the stream of this rank's heads, under torch.compile too (a fused kernel would
// draw from its own).
at::Tensor attention_with_dropout(const at::Tensor& q,
                                  const at::Tensor& k,
                                  const at::Tensor& v,
                                  const std::optional<at::Tensor>& mask,
                                  bool causal,
                                  double dropout_p,
                                  std::optional<double> scale) {
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  auto scores = at::matmul(q, k.transpose(-2, -1)) * s;
  if (mask) {
    scores = scores + *mask;
  } else if (causal) {
    const auto s = q.sym_size(-2);
    const auto above = at::ones_symint({s, s}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(above, -kInfinity);
  }
  return at::matmul(region_dropout(at::softmax(scores, -1), dropout_p, true), v);
}

}  // namespace

at::Tensor attention_heads(const at::Tensor& qkv,
                           const ParallelSelfAttentionOptions& o,
                           const std::optional<at::Tensor>& attn_mask,
                           bool is_causal,
                           bool training) {
  const auto& group = o.group();
  TORCH_CHECK(group, "attention_heads: options.group() is not set");
  TORCH_CHECK(!o.context_parallel() || o.context_group(),
              "attention_heads: options.context_group() is not set");
  const auto context_group = o.context_parallel() ? o.context_group() : nullptr;
  const int64_t num_heads = o.num_heads();
  const double dropout_p = training ? o.dropout() : 0.0;
  const bool recompute_core = o.recompute_core();
  const auto& context_method = o.context_method();
  const bool load_balance = o.load_balance();
  const auto softmax_scale = o.softmax_scale();
  const int64_t heads_local = num_heads / group->getSize();
  TORCH_CHECK(qkv.dim() == 3 && heads_local > 0 && qkv.size(2) % (3 * heads_local) == 0,
              "attention_heads: qkv must be [s, b, 3 * heads * head_dim], got ",
              qkv.sym_sizes(),
              " for ",
              heads_local,
              " heads");
  TORCH_CHECK(!context_group || dropout_p == 0.0,
              "attention_heads: attention dropout (p = ",
              dropout_p,
              ") under context parallelism is not supported: the ranks' masks could not be "
              "those one process draws for the whole sequence; use dropout=0");
  const c10::SymInt s = qkv.sym_size(0);
  const c10::SymInt b = qkv.sym_size(1);
  // The whole sequence, which masks are for: this rank's part times the context ranks.
  const c10::SymInt whole = context_group ? s * context_group->getSize() : s;
  const int64_t width = qkv.size(2) / 3;
  const int64_t head_dim = width / heads_local;
  const bool masked = attn_mask && attn_mask->defined();
  bool per_head = false;
  if (masked) {
    const auto& m = *attn_mask;
    // The same shape test on every rank (a rank-dependent one would leave the others waiting).
    per_head = m.dim() == 3 && m.sym_size(0) == b * num_heads && m.sym_size(1) == whole &&
               m.sym_size(2) == whole;
    TORCH_CHECK(per_head || (m.dim() == 2 && m.sym_size(0) == whole && m.sym_size(1) == whole),
                "attention_heads: attn_mask must be [s, s] or [batch * num_heads, s, s] = [",
                b * num_heads,
                ", ",
                whole,
                ", ",
                whole,
                "]",
                context_group ? " (s the whole sequence under context parallelism)" : "",
                ", got ",
                m.sym_sizes());
    TORCH_CHECK(!recompute_core || !m.requires_grad(),
                "attention_heads: the attention core cannot be recomputed over a mask that "
                "requires grad (pass it detached, or do not recompute the core)");
  }
  const int64_t first_head = group->getRank() * heads_local;
  const bool causal = is_causal && !masked;
  // [s, b, 3 * heads * d] -> q, k, v [b, heads, s, d] (torch::nn::MultiheadAttention's layout)
  // -> attention -> [s, b, heads * d]. The mask is made up inside, so that a recomputed core
  // keeps only the mask it was given.
  const auto core = [=](const std::vector<at::Tensor>& inputs) -> std::vector<at::Tensor> {
    std::optional<at::Tensor> mask;
    if (masked) {
      mask = *attn_mask;
      if (per_head) {  // this rank's heads only
        mask =
            mask->reshape_symint({b, num_heads, whole, whole}).narrow(1, first_head, heads_local);
      }
      if (mask->scalar_type() == at::kBool) {  // true = may not attend, as MultiheadAttention
        mask =
            at::zeros_symint(mask->sym_sizes(), inputs[0].options()).masked_fill(*mask, -kInfinity);
      }
    }
    const auto parts = inputs[0].chunk(3, -1);
    const auto heads = [&](const at::Tensor& t) {
      return t.reshape_symint({s, b, heads_local, head_dim}).permute({1, 2, 0, 3});
    };
    const auto q = heads(parts[0]);
    const auto k = heads(parts[1]);
    const auto v = heads(parts[2]);
    at::Tensor context;
    if (context_group) {
      context = context_parallel::attention(q,
                                            k,
                                            v,
                                            context_group,
                                            context_parallel::AttentionOptions()
                                                .is_causal(causal)
                                                .scale(softmax_scale)
                                                .method(context_method)
                                                .load_balance(load_balance)
                                                .attn_mask(mask));
    } else if (dropout_p > 0) {
      context = attention_with_dropout(q, k, v, mask, causal, dropout_p, softmax_scale);
    } else {
      context = at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, softmax_scale);
    }
    return {context.permute({2, 0, 1, 3}).reshape_symint({s, b, width})};
  };
  if (!recompute_core) {
    return core({qkv})[0];
  }
  return recompute(core, {qkv})[0];
}

void check_parallel_self_attention(const ParallelSelfAttentionOptions& o) {
  TORCH_CHECK(o.group(), "ParallelSelfAttention: options.group() is not set");
  TORCH_CHECK(o.context_parallel() || !o.context_group(),
              "ParallelSelfAttention: a context_group is given but context_parallel is off");
  TORCH_CHECK(!o.context_parallel() || o.context_group(),
              "ParallelSelfAttention: options.context_group() is not set");
  // Agreement first: a check that fails on one rank only would leave the others waiting. Over
  // both groups before raising: a tensor rank that raised at the first would leave its context
  // peers waiting in the second.
  std::exception_ptr failure;
  for (const auto& over : {o.group(), o.context_group()}) {
    if (!over) {
      continue;
    }
    try {
      options::check_same_options(o, over, "ParallelSelfAttention");
    } catch (...) {
      failure = failure ? failure : std::current_exception();
    }
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
  const int64_t hidden_size = o.hidden_size();
  const int64_t num_heads = o.num_heads();
  const auto& methods = context_parallel::kAttentionMethods;
  const bool known_method =
      std::find(methods.begin(), methods.end(), o.context_method()) != methods.end();
  check_non_negative(hidden_size, "ParallelSelfAttention: hidden_size");
  TORCH_CHECK(num_heads > 0 && hidden_size % num_heads == 0,
              "ParallelSelfAttention: hidden_size (",
              hidden_size,
              ") must be divisible by num_heads (",
              num_heads,
              ")");
  divide(num_heads, o.group()->getSize(), "ParallelSelfAttention: num_heads");
  TORCH_CHECK(!o.context_parallel() || known_method,
              "ParallelSelfAttention: context_method must be 'ring', 'all_gather' or "
              "'all_to_all', got '",
              o.context_method(),
              "'");
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

at::Tensor parallel_self_attention(const at::Tensor& x,
                                   const AttentionParameters& p,
                                   const ParallelSelfAttentionOptions& o,
                                   const std::optional<at::Tensor>& attn_mask,
                                   bool is_causal,
                                   bool training) {
  const auto& group = o.group();
  TORCH_CHECK(group, "parallel_self_attention: options.group() is not set");
  const auto qkv = column_parallel_linear(
      x, p.qkv_weight, p.qkv_bias, 3 * o.hidden_size(), false, o.sequence_parallel(), group);
  const auto context = attention_heads(qkv, o, attn_mask, is_causal, training);
  return row_parallel_linear(
      context, p.proj_weight, p.proj_bias, o.hidden_size(), true, o.sequence_parallel(), group);
}

ColumnParallelLinearOptions qkv_options(const ParallelSelfAttentionOptions& o) {
  return ColumnParallelLinearOptions(o.hidden_size(), 3 * o.hidden_size())
      .bias(o.bias())
      .sequence_parallel(o.sequence_parallel())
      .group(o.group());
}

RowParallelLinearOptions proj_options(const ParallelSelfAttentionOptions& o) {
  return RowParallelLinearOptions(o.hidden_size(), o.hidden_size())
      .bias(o.bias())
      .sequence_parallel(o.sequence_parallel())
      .group(o.group());
}

// ---- ParallelSelfAttention --------------------------------------------------------------------

ParallelSelfAttentionImpl::ParallelSelfAttentionImpl(ParallelSelfAttentionOptions options_,
                                                     bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void ParallelSelfAttentionImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  if (options.context_parallel()) {
    options.context_group(context_parallel::cp_group_or_default(options.context_group()));
  }
  const auto& o = options;
  check_parallel_self_attention(o);
  qkv = register_module("qkv", ColumnParallelLinearImpl::uninitialised(qkv_options(o)));
  proj = register_module("proj", RowParallelLinearImpl::uninitialised(proj_options(o)));
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
                  optional_tensor(qkv->bias),
                  dense->in_proj_weight,
                  optional_tensor(dense->in_proj_bias),
                  options.group());
  load_dense_linear_(proj->weight,
                     optional_tensor(proj->bias),
                     dense->out_proj->weight,
                     optional_tensor(dense->out_proj->bias),
                     1,
                     options.group());
}

AttentionParameters ParallelSelfAttentionImpl::weights() const {
  return {qkv->weight, optional_tensor(qkv->bias), proj->weight, optional_tensor(proj->bias)};
}

at::Tensor ParallelSelfAttentionImpl::forward(const at::Tensor& x,
                                              const at::Tensor& attn_mask,
                                              bool is_causal) {
  return parallel_self_attention(
      x, weights(), options, optional_tensor(attn_mask), is_causal, is_training());
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
      gather_dense_qkv(qkv->weight, optional_tensor(qkv->bias), options.group());
  const auto [out_weight, out_bias] =
      gather_dense_linear(proj->weight, optional_tensor(proj->bias), 1, options.group());
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

// ---- the operators ----------------------------------------------------------------------------

namespace {

at::Tensor attention_heads_op(const at::Tensor& qkv,
                              const std::optional<at::Tensor>& attn_mask,
                              bool is_causal,
                              bool training,
                              const ParallelSelfAttentionOptions& options) {
  return attention_heads(qkv, options, attn_mask, is_causal, training);
}

at::Tensor parallel_self_attention_op(const at::Tensor& x,
                                      const at::Tensor& qkv_weight,
                                      const std::optional<at::Tensor>& qkv_bias,
                                      const at::Tensor& proj_weight,
                                      const std::optional<at::Tensor>& proj_bias,
                                      const std::optional<at::Tensor>& attn_mask,
                                      bool is_causal,
                                      bool training,
                                      const ParallelSelfAttentionOptions& options) {
  return parallel_self_attention(
      x, {qkv_weight, qkv_bias, proj_weight, proj_bias}, options, attn_mask, is_causal, training);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&attention_heads_op>(
      m, "attention_heads(Tensor qkv, Tensor? attn_mask, bool is_causal, bool training)");
  options::def_layer_operator<&parallel_self_attention_op>(
      m,
      "parallel_self_attention(Tensor x, Tensor qkv_weight, Tensor? qkv_bias, "
      "Tensor proj_weight, Tensor? proj_bias, Tensor? attn_mask, bool is_causal, "
      "bool training)");
}

}  // namespace torch_mp::tensor_parallel
