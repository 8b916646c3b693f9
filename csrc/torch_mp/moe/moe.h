#pragma once
// A mixture of experts whose experts are spread over an expert group (expert parallelism).
// The one-process module is torch_mp::dense::MoE (dense_moe.h; torch_mp.dense.MoE in Python), and
// this one equals it: rank e of the group holds experts [e E / ep, (e + 1) E / ep) (their
// parameters sharded over the group along the experts' dim, layout.h), the router is
// replicated, and each rank's tokens go where the router sends them:
//
//   1. route this rank's tokens (router.h): each token's top-k experts, their weights;
//   2. sort the choices by expert, exchange the counts, and send each token to its experts'
//      ranks (all_to_all_rows, dispatch.h), once per choice;
//   3. run the local experts over the tokens they received (one grouped matrix product per
//      projection where at::_grouped_mm takes the shapes, else one expert after another);
//   4. send the results back the way they came, and add them up weighted per token.
//
// The backward mirrors it (the all-to-alls' backwards are all-to-alls the other way). aux_loss
// is the load-balancing loss of this rank's tokens, as the dense module computes it on them.
//
// The forward is also the operator torch.ops.torch_mp.moe (what the Python modules call):
//   moe(Tensor x, Tensor router_weight, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight,
//       Tensor? fc2_bias, *, <the declared MoEOptions below>) -> (Tensor, Tensor)
// with group "" for all experts on this rank (the dense module).

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <tuple>

#include "torch_mp/moe/dense_moe.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::moe {

/// This rank's parameters of a mixture of experts: the router's [E, h] weight (whole) and its
/// experts' stacked weights, [E_local, ffn, h] and [E_local, h, ffn] (and biases).
struct MoEParameters {
  at::Tensor router_weight;
  at::Tensor fc1_weight;
  std::optional<at::Tensor> fc1_bias;
  at::Tensor fc2_weight;
  std::optional<at::Tensor> fc2_bias;
};

/// Copies a dense mixture of experts' router and this rank's experts of `group` (`dense`, every
/// expert's weights) into `mine` (this rank's; not differentiable). Raises unless the two hold
/// the same number of experts, with or without biases alike.
void load_dense_(const MoEParameters& mine, const MoEParameters& dense, const GroupPtr& group);

/// The forward of MoE (see the top of this file): `x` [..., h] -> (y shaped as x, aux_loss).
/// `options` as dense::MoEOptions (its sizes are taken from the parameters); `group` the expert
/// group (null: every expert here). A collective over `group`; raises on every rank if the
/// ranks' hidden sizes differ.
std::tuple<at::Tensor, at::Tensor> moe_forward(const at::Tensor& x,
                                               const MoEParameters& parameters,
                                               const dense::MoEOptions& options,
                                               const GroupPtr& group);

/// The options of the expert-parallel mixture of experts, declared once (torch_mp/options.h):
/// the dense module's (dense_moe.h) and the expert group (the default mesh's ep_group when null).
#define TORCH_MP_EXPERT_PARALLEL_MOE_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  TORCH_MP_MOE_OPTIONS(REQUIRED, OPTION, KEYWORD)                       \
  KEYWORD(GroupPtr, group, {})

/// Options of the expert-parallel MoE (those of its operator, torch.ops.torch_mp.moe).
struct MoEOptions {
  TORCH_MP_OPTIONS(MoEOptions, TORCH_MP_EXPERT_PARALLEL_MOE_OPTIONS)
};

/// Checks a mixture of experts' configuration: the routing (router.h), the group size dividing
/// num_experts, and the same configuration on every rank of the group.
void check_moe(const dense::MoEOptions& options, const GroupPtr& group);
/// The same for options that name their group (options.group(); none: one process).
void check_moe(const MoEOptions& options);
/// Raises torch_mp::LayoutError unless `ep` expert-parallel ranks split `num_experts` evenly
/// (what check_moe and plan::estimate ask, in the same words).
void check_expert_split(int64_t num_experts, int64_t ep);

class MoE;

/// A mixture of experts with its experts split over the expert group (see the top of this file).
class MoEImpl : public torch::nn::Cloneable<MoEImpl> {
 public:
  /// The dense module's options; `group` the expert group (the default mesh's ep_group when
  /// null).
  explicit MoEImpl(dense::MoEOptions options, GroupPtr group = {})
      : MoEImpl(std::move(options), std::move(group), /*initialise=*/true) {}
  void reset() override;
  /// Draws a dense::MoE with these options and keeps this rank's experts.
  void reset_parameters();
  /// `x` [..., h]: this rank's tokens. Returns (y, aux_loss).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x);
  /// The parameters as moe_forward takes them.
  MoEParameters weights() const;
  /// Shards `dense` (its options kept) over `group` (the mesh's ep_group when null).
  static MoE from_dense(const dense::MoE& dense, GroupPtr group = {});
  /// Copies this rank's experts of `dense`, and its router, into the parameters.
  void load_dense(const dense::MoE& dense);
  /// The dense module, every expert gathered (a collective over the group).
  dense::MoE to_dense() const;
  /// A deep copy, its layouts recorded (Cloneable's copy replaces the children's tensors).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  dense::MoEOptions options;
  GroupPtr group;
  torch::nn::Linear router = nullptr;
  /// This rank's experts (E / ep of them).
  dense::Experts experts = nullptr;

 private:
  MoEImpl(dense::MoEOptions options, GroupPtr group, bool initialise);
  void register_layouts();
  bool initialise_ = true;
  bool checked_ = false;
};
TORCH_MODULE(MoE);

}  // namespace torch_mp::moe
