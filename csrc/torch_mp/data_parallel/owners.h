#pragma once
// The core's one map from a parameter to what holds it in data parallelism: the engine that
// all-reduces its gradient (GradientSync), the sharded state that reduce-scatters it
// (ShardedState: ZeRO-2/3), and the distributed optimizer's all-gather of it after a step
// that the next forward waits for (overlap_param_gather). Each owner enters its parameters when
// it is made and leaves when it is destroyed; a function given only parameters
// (clip_grad_norm_, a checkpoint, DistributedOptimizer(model.parameters())) finds their owner
// here, in one lookup. The arrow runs one way: optim/ implements ParameterGathers and registers
// itself; data_parallel/ knows nothing of optim/.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace torch_mp::data_parallel {

class GradientSync;
class ShardedState;

/// What an optimizer that all-gathers parameters after its step (and lets the next forward
/// wait) gives the map: a wait for one of its buckets (optim::ParameterShards).
class ParameterGathers {
 public:
  virtual ~ParameterGathers() = default;
  /// Waits for bucket `bucket`'s all-gather, if it is still running.
  virtual void wait_for_bucket(size_t bucket) const = 0;
};

/// What holds one parameter.
struct Owners {
  GradientSync* sync = nullptr;               ///< DataParallel's all-reducing engine
  std::weak_ptr<ShardedState> sharded;        ///< the sharded state (ZeRO-2/3, grad_dtype)
  const ParameterGathers* gathers = nullptr;  ///< the optimizer gathering it after a step
  size_t bucket = 0;                          ///< its bucket there

  bool empty() const { return sync == nullptr && sharded.expired() && gathers == nullptr; }
};

/// Copies of the owners of each of `parameters` (empty where none holds it).
std::vector<Owners> owners_of(const std::vector<at::Tensor>& parameters);

/// Under the map's lock, `change(i, owners)` for each of `parameters` in turn (an entry is made
/// where there was none, and removed when left empty). What `change` raises stops the walk; the
/// parameters changed before it stay changed.
void change_owners(const std::vector<at::Tensor>& parameters,
                   const std::function<void(size_t, Owners&)>& change);

/// Waits for the optimizer's all-gathers (ParameterGathers) that hold any of `parameters`: what
/// a forward calls first under overlap_param_gather. Nothing registered: returns at once.
void wait_for_gathers(const std::vector<at::Tensor>& parameters);

}  // namespace torch_mp::data_parallel
