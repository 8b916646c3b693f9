#include "torch_mp/optim/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>

#include "torch_mp/agreement.h"
#include "torch_mp/collectives.h"
#include "torch_mp/optim/clip_grad.h"

namespace torch_mp {

GradScaler::GradScaler(GradScalerOptions options, std::shared_ptr<Mesh> mesh)
    : GradScaler(options, nullptr, nullptr, nullptr) {
  if (!mesh) {
    mesh = get_mesh();
  }
  tp_group_ = mesh->tp_group;
  pp_group_ = mesh->pp_group;
  dp_group_ = mesh->dp_cp_group;
}

GradScaler::GradScaler(GradScalerOptions options,
                       GroupPtr tp_group,
                       GroupPtr pp_group,
                       GroupPtr dp_group)
    : options_(options),
      tp_group_(std::move(tp_group)),
      pp_group_(std::move(pp_group)),
      dp_group_(std::move(dp_group)),
      scale_(options.init_scale()) {
  // Agreed first (a rank that refused alone would leave the others waiting), and at all: ranks
  // that scaled by different factors would sum gradients of different scales, silently.
  for (const auto& group : {tp_group_, pp_group_, dp_group_}) {
    if (group && group->getSize() > 1) {
      comm::check_same_across_ranks({comm::bits(options_.init_scale()),
                                     comm::bits(options_.growth_factor()),
                                     comm::bits(options_.backoff_factor()),
                                     options_.growth_interval(),
                                     options_.enabled()},
                                    group,
                                    "torch_mp.GradScaler options [init_scale, growth_factor, "
                                    "backoff_factor (bits), growth_interval, enabled]");
    }
  }
  TORCH_CHECK(options_.init_scale() > 0,
              "torch_mp.GradScaler: init_scale must be positive, got ",
              options_.init_scale());
  TORCH_CHECK(options_.growth_factor() > 1.0,
              "torch_mp.GradScaler: growth_factor must be above 1, got ",
              options_.growth_factor());
  TORCH_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1.0,
              "torch_mp.GradScaler: backoff_factor must be in (0, 1), got ",
              options_.backoff_factor());
  TORCH_CHECK(options_.growth_interval() > 0,
              "torch_mp.GradScaler: growth_interval must be positive, got ",
              options_.growth_interval());
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  return options_.enabled() ? loss * scale_ : loss;
}

bool GradScaler::unscale_(const std::vector<at::Tensor>& parameters) {
  if (!options_.enabled()) {
    return false;
  }
  TORCH_CHECK(!unscaled_,
              "torch_mp.GradScaler: unscale_ was already called since the last update()");
  // 1 / S rounded to float, as torch.amp.GradScaler multiplies by it.
  const double inverse = static_cast<float>(1.0 / scale_);
  at::Tensor overflow = at::zeros({}, at::kFloat);
  for (auto& g : local_gradients(parameters)) {
    overflow = at::maximum(overflow, at::logical_not(at::isfinite(g).all()).to(at::kFloat).cpu());
    g.mul_(inverse);
  }
  // Any rank's overflow skips the step everywhere: the union of the three groups is the model.
  for (const auto& group : {tp_group_, pp_group_, dp_group_}) {
    if (group && group->getSize() > 1) {
      overflow = comm::all_reduce(overflow, group, c10d::ReduceOp::MAX);
    }
  }
  found_inf_ = overflow.item<float>() > 0;
  unscaled_ = true;
  return found_inf_;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  if (!unscaled_) {
    std::vector<at::Tensor> parameters;
    for (const auto& group : optimizer.param_groups()) {
      parameters.insert(parameters.end(), group.params().begin(), group.params().end());
    }
    unscale_(parameters);
  }
  if (found_inf_) {
    return false;
  }
  optimizer.step();
  return true;
}

bool GradScaler::found_inf() const { return found_inf_; }

void GradScaler::update() {
  if (!options_.enabled()) {
    return;
  }
  TORCH_CHECK(unscaled_,
              "torch_mp.GradScaler: update() without unscale_ or step since the last update()");
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

void GradScaler::load(double scale, int64_t growth_tracker) {
  TORCH_CHECK(scale > 0, "torch_mp.GradScaler: a loaded scale must be positive, got ", scale);
  TORCH_CHECK(growth_tracker >= 0 && growth_tracker < options_.growth_interval(),
              "torch_mp.GradScaler: a loaded growth tracker must be in [0, growth_interval), got ",
              growth_tracker);
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace torch_mp
