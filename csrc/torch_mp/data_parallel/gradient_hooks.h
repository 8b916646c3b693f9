#pragma once
// What both gradient engines (gradient_sync.h, sharded_state.h) need to know about a
// backward: when each parameter's gradient has been accumulated (a post-hook on its
// AccumulateGrad node, where c10d's Reducer hooks too), and which parameters the armed backward
// gave a gradient, so that a step after one that missed some is refused by name instead of
// stepping this rank's own, un-averaged gradient.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace torch_mp::data_parallel {

/// Calls `on_gradient(i)` each time parameter i's gradient has been accumulated; the hooks go
/// with this object.
class GradientHooks {
 public:
  GradientHooks(const std::vector<at::Tensor>& parameters, std::function<void(size_t)> on_gradient);
  ~GradientHooks();
  GradientHooks(const GradientHooks&) = delete;
  GradientHooks& operator=(const GradientHooks&) = delete;

 private:
  // The accumulators are held here: a parameter holds its own weakly, and a new one would not
  // carry the hook.
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> keys_;
};

/// Which parameters the armed backward gave a gradient. Not thread-safe: its engine locks.
class ArmedBackward {
 public:
  /// For `parameters` named `names` (the module's names of them; empty: by index and shape).
  ArmedBackward(const std::vector<at::Tensor>& parameters, const std::vector<std::string>& names);

  /// A synced backward comes next: no parameter has its gradient yet.
  void arm();
  /// Marks parameter i as having its gradient; true if that is news in an armed backward.
  /// When the last one arrives the backward is complete, and the next needs arm() again.
  bool mark(size_t i);
  /// Raises, naming those without, if the armed backward gave some parameters a gradient but
  /// not all (`owner` begins the message). Nothing armed, or armed with no gradient yet, passes.
  void check_complete(const std::string& owner) const;
  /// Parameter i's name, or "parameter i", with its shape when the engine was built.
  const std::string& name(size_t i) const;

 private:
  std::vector<std::string> labels_;
  std::vector<bool> ready_;
  size_t ready_count_ = 0;
  bool armed_ = false;
};

/// `names[i]` (or "parameter i" where `names` is empty) and parameter i's shape, for errors.
std::string parameter_name(const std::vector<std::string>& names,
                           const std::vector<at::Tensor>& parameters,
                           size_t i);

/// Whether c10d's Reducer (PyTorch's DistributedDataParallel) or one of our engines hooks
/// `parameter`'s gradient accumulator: its gradient is then reduced by someone.
bool has_gradient_hooks(const at::Tensor& parameter);

/// The names of those of `parameters` that require grad, from names aligned with all of them
/// (empty stays empty).
std::vector<std::string> names_requiring_grad(const std::vector<at::Tensor>& parameters,
                                              const std::vector<std::string>& names,
                                              const std::string& owner);

}  // namespace torch_mp::data_parallel
