#include "torch_mp/clip_grad.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"

namespace torch_mp {
namespace {

int64_t rank_in(const GroupPtr& group) { return group ? group->getRank() : 0; }

// Whether this rank's gradient of `p` is part of the model's norm on this rank.
bool counted_here(const at::Tensor& p, const GroupPtr& tp_group) {
  const auto layout = layout_of(p);
  if (!layout) {
    return rank_in(tp_group) == 0;  // a plain module: replicated over the tensor group
  }
  if (layout->tied_copy) {
    return false;
  }
  if (!layout->is_sharded()) {
    return rank_in(layout->group ? layout->group : tp_group) == 0;
  }
  TORCH_CHECK(!layout->group || layout->group->getSize() == 1 || layout->group == tp_group,
              "torch_mp.clip_grad_norm_: a parameter of shape ",
              p.sizes(),
              " is sharded over a group other than the mesh's tensor-parallel group");
  return true;
}

at::Tensor reduce_over(at::Tensor value, const GroupPtr& group, c10d::ReduceOp op) {
  return group && group->getSize() > 1 ? comm::all_reduce(value, group, op) : value;
}

}  // namespace

at::Tensor total_grad_norm(const std::vector<at::Tensor>& parameters,
                           double norm_type,
                           const GroupPtr& tp_group,
                           const GroupPtr& pp_group) {
  TORCH_CHECK(norm_type > 0,
              "torch_mp.clip_grad_norm_: norm_type must be positive (or inf), got ",
              norm_type);
  const bool max_norm = std::isinf(norm_type);
  // Per-tensor norms first, as torch.nn.utils.clip_grad_norm_ takes them; sums in float.
  at::Tensor local = at::zeros({}, at::kFloat);
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined() || !counted_here(p, tp_group)) {
      continue;
    }
    const auto norm = at::linalg_vector_norm(g, norm_type).to(at::kFloat).cpu();
    local = max_norm ? at::maximum(local, norm) : local + norm.pow(norm_type);
  }
  const auto op = max_norm ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  local = reduce_over(reduce_over(local, tp_group, op), pp_group, op);
  return max_norm ? local : local.pow(1.0 / norm_type);
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                           double max_norm,
                           double norm_type,
                           const GroupPtr& tp_group,
                           const GroupPtr& pp_group,
                           bool error_if_nonfinite) {
  const at::Tensor total = total_grad_norm(parameters, norm_type, tp_group, pp_group);
  const double value = total.item<double>();
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(value),
              "torch_mp.clip_grad_norm_: the total norm of order ",
              norm_type,
              " of the gradients is ",
              value,
              " (non-finite); the gradients were not clipped");
  const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (const auto& p : parameters) {
    at::Tensor g = p.grad();
    if (g.defined()) {
      g.mul_(coef.to(g.device()));
    }
  }
  return total;
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                           double max_norm,
                           double norm_type,
                           std::shared_ptr<Mesh> mesh,
                           bool error_if_nonfinite) {
  if (!mesh) {
    mesh = get_mesh();
  }
  return clip_grad_norm_(
      parameters, max_norm, norm_type, mesh->tp_group, mesh->pp_group, error_if_nonfinite);
}

}  // namespace torch_mp
