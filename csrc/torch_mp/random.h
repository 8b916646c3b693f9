#pragma once
// Random-number streams for tensor-parallel regions (docs/design.md §3.3, "RNG tracker"), in the
// base: recomputation (recompute.h) replays them. Python: torch_mp.random.
//
// Dropout outside a tensor-parallel region acts on tensors every rank holds whole, so it must
// draw the same numbers on every rank: the default generator, seeded alike. Dropout inside a
// region acts on each rank's own shard (different neurons), so it must draw different numbers
// per rank: a tracked stream seeded per rank, swapped in for the duration of a `fork`.

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "torch_mp/process_groups.h"

namespace torch_mp {

/// The stream `model_parallel_manual_seed` sets up for tensor-parallel regions.
inline constexpr const char* kModelParallelRng = "model-parallel-rng";

/// Named random-number streams that can stand in for a device's default generator for a while.
class RngTracker {
 public:
  /// Adds (or re-seeds) stream `name` on `device` (CPU or a CUDA device), seeded with `seed`.
  void add(const std::string& name, uint64_t seed, c10::Device device = c10::kCPU);
  /// Whether stream `name` exists on `device`.
  bool has(const std::string& name, c10::Device device = c10::kCPU) const;
  /// Forgets every stream.
  void reset();

  /// Every stream's state, by (name, device), e.g. to replay them when a forward is recomputed
  /// (torch_mp::RandomState); set_states makes such a snapshot current again.
  using States = std::map<std::pair<std::string, std::string>, at::Tensor>;
  States states() const;
  void set_states(States states);

  /// Puts stream `name` in place of `device`'s default generator; returns the default's state,
  /// which `swap_out` restores. Raises if the stream does not exist.
  at::Tensor swap_in(const std::string& name, c10::Device device);
  /// Saves the advanced stream `name` and restores the default generator to `default_state`.
  void swap_out(const std::string& name, c10::Device device, const at::Tensor& default_state);

  /// Runs with stream `name` as the default generator while it lives (RAII form of swap_in/out).
  class Fork {
   public:
    Fork(RngTracker& tracker, std::string name, c10::Device device);
    ~Fork();
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;

   private:
    RngTracker& tracker_;
    std::string name_;
    c10::Device device_;
    at::Tensor default_state_;
  };
  /// Forks into stream `name` on `device`.
  Fork fork(const std::string& name = kModelParallelRng, c10::Device device = c10::kCPU) {
    return Fork(*this, name, device);
  }

 private:
  mutable std::mutex mutex_;
  States states_;  // by name, device
};

/// The process-wide tracker.
RngTracker& rng_tracker();

/// Dropout on a tensor that differs between the ranks (a shard of a tensor-parallel region, or
/// rows under sequence parallelism): drawn from the tracker's kModelParallelRng stream when it is
/// set up on x's device (model_parallel_manual_seed), else from the default generator. On the CPU
/// it draws what at::dropout draws. Also the operator torch.ops.torch_mp.region_dropout(x, p,
/// training): its mask comes from the operator region_dropout_noise, whose kernel runs at run
/// time under torch.compile too, so compiled code draws from the same stream as eager code.
at::Tensor region_dropout(const at::Tensor& x, double p, bool training);

/// Seeds `device`'s default generator with `seed` (the same stream on every rank) and the
/// tracker's kModelParallelRng stream with seed + 2718 + the rank in `group` (a stream per rank).
void model_parallel_manual_seed(uint64_t seed,
                                const GroupPtr& group,
                                c10::Device device = c10::kCPU);

}  // namespace torch_mp
