// A mixture of experts over an expert group (moe.h).

#include "torch_mp/moe/moe.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"
#include "torch_mp/errors.h"
#include "torch_mp/layout.h"
#include "torch_mp/mesh.h"
#include "torch_mp/moe/dispatch.h"
#include "torch_mp/moe/experts.h"
#include "torch_mp/moe/router.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::moe {
namespace {

// Whether at::_grouped_mm takes the local experts' products: no biases, rows and weights whose
// strides are multiples of 16 bytes, and a dtype it has (on CUDA bf16, its fast kernel's; on the
// CPU fp32, bf16 and fp16).
bool grouped_mm_fits(const MoEParameters& p, const at::Tensor& rows) {
  const auto dtype = rows.scalar_type();
  const bool kind =
      rows.is_cuda()
          ? dtype == at::kBFloat16
          : rows.is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
  const auto aligned = [&](int64_t n) { return n * rows.element_size() % 16 == 0; };
  const auto fits = [&](const at::Tensor& w) {
    return w.scalar_type() == dtype && w.device() == rows.device() && w.is_contiguous();
  };
  // (No rows: the loop, not a grouped product of nothing.)
  return kind && rows.size(0) > 0 && !p.fc1_bias && !p.fc2_bias && fits(p.fc1_weight) &&
         fits(p.fc2_weight) && aligned(p.fc1_weight.size(2)) && aligned(p.fc2_weight.size(2));
}

// The local experts over `rows` grouped by expert (`counts` rows each): one grouped matrix
// product per projection where at::_grouped_mm fits, else one expert after another. An expert
// given no rows takes part either way: its parameters then get a zero gradient, not none, so that
// a data-parallel reduction finds every gradient it waits for.
at::Tensor run_experts(const MoEParameters& p,
                       const at::Tensor& rows,
                       const std::vector<int64_t>& counts,
                       const std::string& activation) {
  if (grouped_mm_fits(p, rows)) {
    std::vector<int32_t> ends;
    int64_t end = 0;
    for (const auto n : counts) {
      ends.push_back(static_cast<int32_t>(end += n));
    }
    const auto offsets = at::tensor(ends, at::kInt).to(rows.device());
    const auto hidden = at::_grouped_mm(rows, p.fc1_weight.transpose(1, 2), offsets);
    return at::_grouped_mm(
        expert_activation(hidden, activation), p.fc2_weight.transpose(1, 2), offsets);
  }
  std::vector<at::Tensor> outputs;
  int64_t first = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    outputs.push_back(dense::expert_mlp(rows.narrow(0, first, counts[i]),
                                        static_cast<int64_t>(i),
                                        p.fc1_weight,
                                        p.fc1_bias,
                                        p.fc2_weight,
                                        p.fc2_bias,
                                        activation));
    first += counts[i];
  }
  return at::cat(outputs);
}

// The host's copy of an int64 tensor's values.
std::vector<int64_t> as_vector(const at::Tensor& t) {
  const auto c = t.cpu().contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

}  // namespace

void check_moe(const dense::MoEOptions& o, const GroupPtr& group) {
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  if (group) {
    options::check_same_options(o, group, "MoE");
  }
  dense::check_moe(o);
  check_expert_split(o.num_experts(), group ? group->getSize() : 1);
}

void check_expert_split(int64_t num_experts, int64_t ep) {
  TORCH_MP_CHECK_LAYOUT(num_experts % ep == 0,
                        "MoE: num_experts (",
                        num_experts,
                        ") must be divisible by the expert-parallel size (",
                        ep,
                        ")");
}

std::tuple<at::Tensor, at::Tensor> moe_forward(const at::Tensor& x,
                                               const MoEParameters& p,
                                               const dense::MoEOptions& o,
                                               const GroupPtr& group) {
  TORCH_CHECK(x.dim() >= 1, "MoE: the input must be [..., hidden], got ", x.sizes());
  const int64_t hidden = x.size(-1);
  const int64_t ranks = group ? group->getSize() : 1;
  const int64_t num_experts = p.router_weight.size(0);
  const int64_t local_experts = p.fc1_weight.size(0);
  TORCH_CHECK(local_experts * ranks == num_experts,
              "MoE: ",
              local_experts,
              " experts on each of ",
              ranks,
              " ranks for a router of ",
              num_experts);
  if (ranks > 1 && hidden != p.router_weight.size(1)) {
    // Routing would fail on this rank alone: the counts' hidden-size column tells the others
    // first (below), so that every rank raises.
    const auto on_device = at::TensorOptions(at::kLong).device(x.device());
    exchange_counts(at::cat({at::zeros({ranks, local_experts}, on_device),
                             at::full({ranks, 1}, hidden, on_device)},
                            1),
                    group);
    TORCH_CHECK(false,
                "MoE: the ranks of the expert group pass different hidden sizes (rank ",
                group->getRank(),
                " has ",
                hidden,
                " for a router of hidden size ",
                p.router_weight.size(1),
                ")");
  }
  const auto tokens = x.reshape({-1, hidden});
  const auto r = route(tokens, p.router_weight, o.top_k(), o.router(), o.capacity_factor());

  // The kept choices, sorted by expert (stably: token order within an expert).
  const auto kept = r.kept.flatten().nonzero().squeeze(1);
  const auto expert_of = r.experts.flatten().index_select(0, kept);
  const auto order = std::get<1>(expert_of.sort(/*stable=*/std::optional<bool>(true), 0));
  const auto choice = kept.index_select(0, order);  // into the [T * k] choices
  const auto token = at::floor_divide(choice, o.top_k());
  const auto weight = r.weights.flatten().index_select(0, choice);
  // On the tokens' device: the counts travel as the group's tensors (NCCL's are CUDA tensors).
  const auto per_expert = at::bincount(expert_of, {}, num_experts);

  const auto sent = tokens.index_select(0, token);
  at::Tensor results;
  if (ranks == 1) {
    results = run_experts(p, sent, as_vector(per_expert), o.activation());
  } else {
    // The counts for each rank's experts, and this rank's hidden size (checked on arrival: a
    // rank that differs from any other makes every rank raise, before the tokens move).
    const auto counts = at::cat({per_expert.view({ranks, local_experts}),
                                 at::full({ranks, 1}, hidden, per_expert.options())},
                                1);
    // [ranks, local experts + 1], read on the host from here on
    const auto received = exchange_counts(counts, group).cpu();
    const auto hiddens = received.select(1, local_experts);
    TORCH_CHECK(hiddens.eq(hidden).all().item<bool>(),
                "MoE: the ranks of the expert group pass different hidden sizes (rank ",
                group->getRank(),
                " has ",
                hidden,
                ", the group's are ",
                c10::IntArrayRef(as_vector(hiddens)),
                ")");
    const auto from = received.narrow(1, 0, local_experts);  // [source rank, local expert]
    const auto send_counts = as_vector(counts.narrow(1, 0, local_experts).sum(1));
    const auto recv_counts = as_vector(from.sum(1));
    // Rows arrive by source rank, then by expert; the experts want them by expert, then by
    // source rank: `regroup` lists the arrived rows in that order.
    const auto f = from.contiguous();
    const auto* n = f.data_ptr<int64_t>();
    std::vector<int64_t> starts(static_cast<size_t>(ranks * local_experts));
    int64_t at_row = 0;
    for (int64_t j = 0; j < ranks * local_experts; ++j) {
      starts[j] = at_row;
      at_row += n[j];
    }
    std::vector<int64_t> regroup;
    regroup.reserve(static_cast<size_t>(at_row));
    for (int64_t e = 0; e < local_experts; ++e) {
      for (int64_t j = 0; j < ranks; ++j) {
        for (int64_t i = 0; i < n[j * local_experts + e]; ++i) {
          regroup.push_back(starts[j * local_experts + e] + i);
        }
      }
    }
    const auto by_expert = at::tensor(regroup, at::kLong).to(x.device());
    const auto arrived = all_to_all_rows(sent, send_counts, recv_counts, group);
    const auto outputs =
        run_experts(p, arrived.index_select(0, by_expert), as_vector(from.sum(0)), o.activation());
    // Back to arrival order (the inverse permutation), and home.
    const auto back = at::empty_like(by_expert).index_put_(
        {by_expert}, at::arange(by_expert.size(0), by_expert.options()));
    results = all_to_all_rows(outputs.index_select(0, back), recv_counts, send_counts, group);
  }
  // The weights are fp32 (router.cpp): the products in fp32, cast back (as Mixtral's block).
  const auto weighted = (results * weight.unsqueeze(1)).to(tokens.scalar_type());
  const auto y = at::zeros_like(tokens).index_add(0, token, weighted);
  return {y.view(x.sizes()), load_balancing_loss(r, o.aux_loss_coef())};
}

void check_moe(const MoEOptions& o) {
  check_moe(options::same_named<dense::MoEOptions>(o), o.group());
}

// ---- MoE --------------------------------------------------------------------------------------

MoEImpl::MoEImpl(dense::MoEOptions options_, GroupPtr group_, bool initialise)
    : options(std::move(options_)), group(std::move(group_)), initialise_(initialise) {
  reset();
}

void MoEImpl::reset() {
  group = group ? group : get_mesh()->ep_group;
  const auto& o = options;
  if (!checked_) {  // (a clone, whose reset runs on its own rank only, was checked as the original)
    check_moe(o, group);
    checked_ = true;
  }
  router = register_module(
      "router",
      torch::nn::Linear(torch::nn::LinearOptions(o.hidden_size(), o.num_experts()).bias(false)));
  experts = register_module("experts",
                            dense::Experts(o.hidden_size(),
                                           o.ffn_hidden_size(),
                                           o.num_experts() / group->getSize(),
                                           o.activation(),
                                           o.bias()));
  register_layouts();
  if (initialise_) {
    reset_parameters();
    initialise_ = false;  // (a clone copies the values instead of drawing them)
  }
}

void MoEImpl::register_layouts() {
  set_replicated(router->weight, group);
  for (const auto& p : experts->parameters()) {  // this rank's experts
    set_sharded(p, 0, group);
  }
}

void MoEImpl::reset_parameters() { load_dense(dense::MoE(options)); }

void load_dense_(const MoEParameters& mine, const MoEParameters& dense, const GroupPtr& group) {
  const int64_t experts = mine.router_weight.size(0);
  const int64_t dense_experts = dense.router_weight.size(0);
  const bool bias = mine.fc1_bias.has_value(), dense_bias = dense.fc1_bias.has_value();
  TORCH_CHECK(dense_experts == experts && dense_bias == bias,
              "MoE.load_dense: the dense module has ",
              dense_experts,
              " experts",
              dense_bias ? " with" : " without",
              " biases; this one ",
              experts,
              bias ? " with" : " without");
  at::NoGradGuard no_grad;
  mine.router_weight.copy_(dense.router_weight);
  mine.fc1_weight.copy_(tensor_parallel::shard(dense.fc1_weight, 0, group));
  mine.fc2_weight.copy_(tensor_parallel::shard(dense.fc2_weight, 0, group));
  if (bias) {
    mine.fc1_bias->copy_(tensor_parallel::shard(*dense.fc1_bias, 0, group));
    mine.fc2_bias->copy_(tensor_parallel::shard(*dense.fc2_bias, 0, group));
  }
}

void MoEImpl::load_dense(const dense::MoE& dense) {
  using tensor_parallel::optional_tensor;
  const auto& d = dense->experts;
  load_dense_(weights(),
              {dense->router->weight,
               d->fc1_weight,
               optional_tensor(d->fc1_bias),
               d->fc2_weight,
               optional_tensor(d->fc2_bias)},
              group);
}

std::tuple<at::Tensor, at::Tensor> MoEImpl::forward(const at::Tensor& x) {
  return moe_forward(x, weights(), options, group);
}

MoEParameters MoEImpl::weights() const {
  using tensor_parallel::optional_tensor;
  return {router->weight,
          experts->fc1_weight,
          optional_tensor(experts->fc1_bias),
          experts->fc2_weight,
          optional_tensor(experts->fc2_bias)};
}

MoE MoEImpl::from_dense(const dense::MoE& dense, GroupPtr group) {
  auto layer = MoE(std::shared_ptr<MoEImpl>(
      new MoEImpl(dense->options, std::move(group), /*initialise=*/false)));
  const auto& weight = dense->router->weight;
  layer->to(weight.device(), weight.scalar_type());
  layer->load_dense(dense);
  return layer;
}

dense::MoE MoEImpl::to_dense() const {
  const tensor_parallel::KeepDefaultRng
      keep_rng;  // the dense module's own initialisation is overwritten
  dense::MoE dense(options);
  const auto& weight = router->weight;
  dense->to(weight.device(), weight.scalar_type());
  at::NoGradGuard no_grad;
  dense->router->weight.copy_(weight);
  const auto mine = experts->named_parameters();
  for (auto& item : dense->experts->named_parameters()) {
    item.value().copy_(comm::all_gather(mine[item.key()].contiguous(), 0, group));
  }
  return dense;
}

std::shared_ptr<torch::nn::Module> MoEImpl::clone(
    const std::optional<torch::Device>& device) const {
  auto copy = Cloneable::clone(device);
  std::dynamic_pointer_cast<MoEImpl>(copy)->register_layouts();
  return copy;
}

// ---- the operator -----------------------------------------------------------------------------

namespace {

std::tuple<at::Tensor, at::Tensor> moe_op(const at::Tensor& x,
                                          const at::Tensor& router_weight,
                                          const at::Tensor& fc1_weight,
                                          const std::optional<at::Tensor>& fc1_bias,
                                          const at::Tensor& fc2_weight,
                                          const std::optional<at::Tensor>& fc2_bias,
                                          const MoEOptions& o) {
  TORCH_CHECK(router_weight.dim() == 2 && router_weight.size(0) == o.num_experts() &&
                  router_weight.size(1) == o.hidden_size() && o.bias() == fc1_bias.has_value(),
              "moe: the router's weight ",
              router_weight.sizes(),
              " or the experts' biases do not fit the options (",
              options::describe(o),
              ")");
  return moe_forward(x,
                     {router_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias},
                     options::same_named<dense::MoEOptions>(o),
                     o.group());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&moe_op>(
      m,
      "moe(Tensor x, Tensor router_weight, Tensor fc1_weight, Tensor? fc1_bias, "
      "Tensor fc2_weight, Tensor? fc2_bias)",
      "(Tensor, Tensor)");
}

}  // namespace torch_mp::moe
