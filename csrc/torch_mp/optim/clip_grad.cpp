#include "torch_mp/optim/clip_grad.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>
#include <utility>

#include "torch_mp/collectives.h"
#include "torch_mp/data_parallel/sharded_state.h"
#include "torch_mp/layout.h"

namespace torch_mp {
namespace {

int64_t rank_in(const GroupPtr& group) { return group ? group->getRank() : 0; }

// Where this rank's gradient of a parameter enters the model's norm: not at all (a copy another
// rank counts), in this rank's part, or in the experts' part, which is summed over the expert
// group first (each of its ranks holds other experts).
enum class Counted { kNo, kHere, kExpert };

Counted counted(const at::Tensor& p, const GroupPtr& tp_group, const GroupPtr& ep_group) {
  const auto first_tensor_rank = rank_in(tp_group) == 0 ? Counted::kHere : Counted::kNo;
  const auto layout = layout_of(p);
  if (!layout) {
    return first_tensor_rank;  // a plain module: replicated over the tensor group
  }
  if (layout->tied_copy) {
    return Counted::kNo;
  }
  if (ep_group && layout->group == ep_group) {
    // An expert (replicated over the tensor group), or a router replicated over the experts'
    // ranks as over the data ranks.
    if (!layout->is_sharded()) {
      return first_tensor_rank;
    }
    return rank_in(tp_group) == 0 ? Counted::kExpert : Counted::kNo;
  }
  if (!layout->is_sharded()) {
    return rank_in(layout->group ? layout->group : tp_group) == 0 ? Counted::kHere : Counted::kNo;
  }
  TORCH_CHECK(!layout->group || layout->group->getSize() == 1 || layout->group == tp_group,
              "torch_mp.clip_grad_norm_: a parameter of shape ",
              p.sizes(),
              " is sharded over a group other than the mesh's tensor-parallel (or expert) group");
  return Counted::kHere;
}

at::Tensor reduce_over(at::Tensor value, const GroupPtr& group, c10d::ReduceOp op) {
  return group && group->getSize() > 1 ? comm::all_reduce(value, group, op) : value;
}

// The gradients of `parameters` that a DataParallel(shard_gradients=True) holds (their .grad is
// empty): this rank's pieces of them, by engine, with the parameter of each.
struct ShardedGradients {
  GroupPtr group;  // the data-parallel group the pieces are spread over
  std::vector<at::Tensor> pieces;
  std::vector<at::Tensor> parameters;
};

std::vector<ShardedGradients> sharded_gradients(const std::vector<at::Tensor>& parameters) {
  std::vector<std::pair<std::shared_ptr<data_parallel::ShardedState>,
                        std::unordered_set<const c10::TensorImpl*>>>
      engines;
  for (const auto& p : parameters) {
    if (p.grad().defined()) {
      continue;
    }
    auto engine = data_parallel::ShardedState::of(p);
    if (!engine) {
      continue;
    }
    auto found = std::find_if(
        engines.begin(), engines.end(), [&](const auto& e) { return e.first == engine; });
    if (found == engines.end()) {
      engines.emplace_back(engine, std::unordered_set<const c10::TensorImpl*>{});
      found = engines.end() - 1;
    }
    found->second.insert(p.unsafeGetTensorImpl());
  }
  std::vector<ShardedGradients> out;
  for (const auto& [engine, wanted] : engines) {
    ShardedGradients gradients{engine->group(), {}, {}};
    const auto& pieces = engine->layout().pieces;
    for (size_t s = 0; s < pieces.size(); ++s) {
      const at::Tensor& p = engine->parameters()[pieces[s].parameter];
      at::Tensor g = engine->piece_gradient(s);
      if (g.defined() && wanted.count(p.unsafeGetTensorImpl())) {
        gradients.pieces.push_back(g);
        gradients.parameters.push_back(p);
      }
    }
    out.push_back(std::move(gradients));
  }
  return out;
}

}  // namespace

at::Tensor total_grad_norm(const std::vector<at::Tensor>& parameters,
                           double norm_type,
                           const GroupPtr& tp_group,
                           const GroupPtr& pp_group,
                           const GroupPtr& ep_group) {
  TORCH_CHECK(norm_type > 0,
              "torch_mp.clip_grad_norm_: norm_type must be positive (or inf), got ",
              norm_type);
  const bool max_norm = std::isinf(norm_type);
  // Per-tensor norms first, as torch.nn.utils.clip_grad_norm_ takes them; sums in float.
  at::Tensor local = at::zeros({}, at::kFloat);
  at::Tensor experts = at::zeros({}, at::kFloat);
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    const auto where = g.defined() ? counted(p, tp_group, ep_group) : Counted::kNo;
    if (where == Counted::kNo) {
      continue;
    }
    auto& part = where == Counted::kExpert ? experts : local;
    const auto norm = at::linalg_vector_norm(g, norm_type).to(at::kFloat).cpu();
    part = max_norm ? at::maximum(part, norm) : part + norm.pow(norm_type);
  }
  const auto op = max_norm ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  // (Every rank of an expert group takes part; a group of one rank needs no reduction.)
  experts = reduce_over(experts, ep_group, op);
  local = max_norm ? at::maximum(local, experts) : local + experts;
  // Gradients reduce-scattered over a data group: each element on one rank of it.
  for (const auto& sharded : sharded_gradients(parameters)) {
    at::Tensor part = at::zeros({}, at::kFloat);
    for (size_t i = 0; i < sharded.pieces.size(); ++i) {
      if (counted(sharded.parameters[i], tp_group, ep_group) == Counted::kHere) {
        const auto norm = at::linalg_vector_norm(sharded.pieces[i], norm_type).to(at::kFloat).cpu();
        part = max_norm ? at::maximum(part, norm) : part + norm.pow(norm_type);
      }
    }
    part = reduce_over(part, sharded.group, op);
    local = max_norm ? at::maximum(local, part) : local + part;
  }
  local = reduce_over(reduce_over(local, tp_group, op), pp_group, op);
  return max_norm ? local : local.pow(1.0 / norm_type);
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                           double max_norm,
                           double norm_type,
                           const GroupPtr& tp_group,
                           const GroupPtr& pp_group,
                           bool error_if_nonfinite,
                           const GroupPtr& ep_group) {
  const at::Tensor total = total_grad_norm(parameters, norm_type, tp_group, pp_group, ep_group);
  const double value = total.item<double>();
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(value),
              "torch_mp.clip_grad_norm_: the total norm of order ",
              norm_type,
              " of the gradients is ",
              value,
              " (non-finite); the gradients were not clipped");
  const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (auto& g : local_gradients(parameters)) {
    g.mul_(coef.to(g.device()));
  }
  return total;
}

std::vector<at::Tensor> local_gradients(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> out;
  for (const auto& p : parameters) {
    if (p.grad().defined()) {
      out.push_back(p.grad());
    }
  }
  for (auto& sharded : sharded_gradients(parameters)) {
    out.insert(out.end(), sharded.pieces.begin(), sharded.pieces.end());
  }
  return out;
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                           double max_norm,
                           double norm_type,
                           std::shared_ptr<Mesh> mesh,
                           bool error_if_nonfinite) {
  if (!mesh) {
    mesh = get_mesh();
  }
  return clip_grad_norm_(parameters,
                         max_norm,
                         norm_type,
                         mesh->tp_group,
                         mesh->pp_group,
                         error_if_nonfinite,
                         mesh->ep_group);
}

}  // namespace torch_mp
