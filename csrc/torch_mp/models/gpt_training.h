#pragma once
// How the GPT of torch_mp::models is trained: torch_mp.models.gpt_training's twin (its learning
// rate schedule; the trainers are the examples' own, examples/cpp/gpt_3d.cpp).

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace torch_mp::models {

/// AdamW's learning rate over the steps: torch_mp.models.TrainingOptions's schedule.
struct LearningRate {
  double lr = 3e-3;
  int64_t warmup = 0;
  int64_t decay_steps = 0;
  double min_lr = 0.0;

  /// At step `step` (from 1): rising linearly to lr over the first `warmup` steps, then falling
  /// to min_lr along a half cosine that ends at step decay_steps (lr throughout when it is 0).
  double at(int64_t step) const {
    if (step <= warmup) {
      return lr * static_cast<double>(step) / static_cast<double>(warmup);
    }
    if (decay_steps <= 0) {
      return lr;
    }
    const double done =
        std::min(1.0,
                 static_cast<double>(step - warmup) /
                     static_cast<double>(std::max<int64_t>(1, decay_steps - warmup)));
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * done));
  }
};

}  // namespace torch_mp::models
