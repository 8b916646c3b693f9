#pragma once
// The one-process mixture of experts and its stacked experts (torch_mp.dense.MoE and Experts'
// twins): the reference the expert-parallel MoE (moe.h) equals, made of the same routing
// (router.h) and experts (experts.h), with every expert on this process.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <tuple>

#include "torch_mp/options.h"

namespace torch_mp::dense {

/// Expert `i` of stacked expert weights (as ExpertsImpl holds them) on the rows `x` [n, hidden]:
/// fc2(activation(fc1(x))). What the dense and the expert-parallel MoE both run.
at::Tensor expert_mlp(const at::Tensor& x,
                      int64_t i,
                      const at::Tensor& fc1_weight,
                      const std::optional<at::Tensor>& fc1_bias,
                      const at::Tensor& fc2_weight,
                      const std::optional<at::Tensor>& fc2_bias,
                      const std::string& activation);

/// `num_experts` MLPs fc2(activation(fc1(x))) stacked: fc1_weight [E, ffn, hidden], fc2_weight
/// [E, hidden, ffn] (and [E, ffn], [E, hidden] biases), each expert initialised as a
/// torch::nn::Linear pair is. The experts' dim comes first, so that expert parallelism splits
/// them along it (torch_mp.dense.Experts' twin). With activation "swiglu" they are gated, as
/// Mixtral's: fc1_weight is [E, 2 ffn, hidden], the gate projection's rows then the up
/// projection's, and an expert is fc2(silu(gate(x)) * up(x)) (moe/experts.h).
class ExpertsImpl : public torch::nn::Cloneable<ExpertsImpl> {
 public:
  ExpertsImpl(int64_t hidden_size,
              int64_t ffn_hidden_size,
              int64_t num_experts,
              std::string activation = "gelu",
              bool bias = false);
  void reset() override;
  /// Each expert's pair drawn as torch::nn::Linear draws itself, expert after expert.
  void reset_parameters();
  /// Expert `i` on the rows `x` [n, hidden].
  at::Tensor expert(int64_t i, const at::Tensor& x) const;

  int64_t hidden_size, ffn_hidden_size, num_experts;
  std::string activation;
  bool bias;
  at::Tensor fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};
TORCH_MODULE(Experts);

/// The options of a mixture of experts, declared once (torch_mp/options.h); the expert-parallel
/// module's (moe/moe.h) add its group:
/// - hidden_size, ffn_hidden_size: the experts' sizes; num_experts: how many;
/// - top_k: experts per token;
/// - activation: the experts': "gelu", "relu" or the gated "swiglu" (ExpertsImpl);
/// - router: "softmax" (Mixtral's) or "sigmoid" (DeepSeek-V3's), each renormalised over the top
///   k;
/// - capacity_factor: none: dropless; else each expert takes at most
///   ceil(capacity_factor * tokens * top_k / E) tokens, the first in token order;
/// - aux_loss_coef: the load-balancing loss's coefficient;
/// - bias: biases on the experts' projections.
#define TORCH_MP_MOE_OPTIONS(REQUIRED, OPTION, KEYWORD)         \
  REQUIRED(int64_t, hidden_size)                                \
  REQUIRED(int64_t, ffn_hidden_size)                            \
  REQUIRED(int64_t, num_experts)                                \
  OPTION(int64_t, top_k, 2)                                     \
  KEYWORD(std::string, activation, "gelu")                      \
  KEYWORD(std::string, router, "softmax")                       \
  KEYWORD(std::optional<double>, capacity_factor, std::nullopt) \
  KEYWORD(double, aux_loss_coef, 0.01)                          \
  KEYWORD(bool, bias, false)

/// Options of MoE.
struct MoEOptions {
  TORCH_MP_OPTIONS(MoEOptions, TORCH_MP_MOE_OPTIONS)
};

/// Checks a one-process mixture of experts' options: the routing (moe/router.h) and the
/// experts' activation.
void check_moe(const MoEOptions& options);

/// A mixture of experts on one process (torch_mp.dense.MoE's twin; its definitions are
/// moe/router.h's): a linear router without bias picks each token's top-k experts, whose
/// outputs are summed with the routing weights. forward returns (y shaped as x, aux_loss).
class MoEImpl : public torch::nn::Cloneable<MoEImpl> {
 public:
  explicit MoEImpl(MoEOptions options);
  void reset() override;
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x);

  MoEOptions options;
  torch::nn::Linear router = nullptr;
  Experts experts = nullptr;
};
TORCH_MODULE(MoE);

}  // namespace torch_mp::dense
