#pragma once
// Dynamic loss scaling for 16-bit (fp16) training over the mesh: torch.amp.GradScaler's
// algorithm, with the overflow check agreed by every rank of the model.
//
// fp16's range ends at 65504 and its normal numbers at 6e-5: small gradients underflow to zero
// unless the loss is multiplied by a scale S before the backward. The gradients are then S times
// too large; unscale_ divides them by S and checks them for inf/NaN, and an overflow on any rank
// (one tensor shard, one pipeline stage, one data rank's pieces) skips the step on all of them,
// as a single process would skip it. update() then halves S (backoff_factor) after a skipped
// step and doubles it (growth_factor) after growth_interval steps in a row without one.
//
//   scaler.scale(loss).backward();          // or the pipeline's loss function returns it scaled
//   scaler.unscale_(parameters);            // before clipping, if clipping
//   clip_grad_norm_(parameters, 1.0);
//   scaler.step(optimizer);                 // skipped on every rank if any rank overflowed
//   scaler.update();
//
// The gradients are those an optimizer over the parameters steps from: each parameter's .grad,
// or this rank's pieces of those a DataParallel(shard_gradients=True) holds (ZeRO-2, fp32 main
// gradients included).

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "torch_mp/mesh.h"

namespace torch_mp {

/// Options of GradScaler (torch.amp.GradScaler's defaults).
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// When false, scale, unscale_ and update do nothing and step always steps.
  TORCH_ARG(bool, enabled) = true;
};

/// Dynamic loss scaling over the mesh (see the top of this file).
class GradScaler {
 public:
  /// Agrees on overflows over `mesh`'s tensor, pipeline and data groups (the default mesh when
  /// null). Raises if a factor or the interval is out of range.
  explicit GradScaler(GradScalerOptions options = {}, std::shared_ptr<Mesh> mesh = nullptr);
  /// The same over the given groups (any may be null for a size of one).
  GradScaler(GradScalerOptions options, GroupPtr tp_group, GroupPtr pp_group, GroupPtr dp_group);

  /// `loss` times the scale.
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides the gradients of `parameters` (this rank's: see the top of this file) by the scale
  /// and returns whether any rank's were inf or NaN (a collective over the groups). Once per
  /// step: a second call before update() raises.
  bool unscale_(const std::vector<at::Tensor>& parameters);
  /// Unscales the optimizer's parameters' gradients unless unscale_ ran this step, then steps
  /// it unless some rank overflowed. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Whether this step's gradients overflowed on some rank (after unscale_).
  bool found_inf() const;
  /// Whether unscale_ (or step) ran since the last update().
  bool unscaled() const { return unscaled_; }
  /// Halves the scale after an overflow, doubles it after growth_interval clean steps; readies
  /// the next step.
  void update();

  double get_scale() const { return options_.enabled() ? scale_ : 1.0; }
  /// Clean steps since the scale last changed.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Restores a saved scale and growth tracker (checkpoints).
  void load(double scale, int64_t growth_tracker);
  const GradScalerOptions& options() const { return options_; }

 private:
  GradScalerOptions options_;
  GroupPtr tp_group_, pp_group_, dp_group_;
  double scale_;
  int64_t growth_tracker_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace torch_mp
