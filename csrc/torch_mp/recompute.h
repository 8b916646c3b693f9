#pragma once
// Activation recomputation that replays every random stream (docs/design.md §5b).
//
// A recomputed forward must draw the random numbers the first forward drew, or its dropout masks,
// and with them the gradients, differ from the step that was not recomputed. The default
// generators are one stream; dropout inside tensor-parallel regions draws from another, the RNG
// tracker's per-rank stream (random.h). torch.utils.checkpoint replays the
// first only, so the core refuses a tracker draw it would recompute (check_recomputable_draw);
// recompute() here, and torch_mp.recompute in Python, replay both.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torch_mp {

/// Every random stream a forward may draw from: the default generators of the CPU and of the
/// given (CUDA) devices, and all of the RNG tracker's streams.
class RandomState {
 public:
  /// The streams as they are now.
  static RandomState capture(const std::vector<c10::Device>& devices = {});
  /// Makes them current again.
  void restore() const;

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> generators_;
  std::map<std::pair<std::string, std::string>, at::Tensor> tracker_;
};

/// Marks this thread as running a forward whose random streams are replayed when it is
/// recomputed, so the RNG tracker's streams may be drawn from in it. Only at the saved-tensor
/// hooks depth where it was made: a torch.utils.checkpoint nested inside is still refused.
class RecomputeScope {
 public:
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  std::ptrdiff_t saved_depth_;
};

/// Called before every draw from the RNG tracker's per-rank stream. Raises if the forward being
/// run will be recomputed without replaying that stream: under torch.utils.checkpoint's saved-
/// tensor hooks (known through the probe the Python bindings install), or inside a backward pass
/// (a reentrant checkpoint's recomputation), unless a RecomputeScope covers it.
void check_recomputable_draw();

/// Installs the test of whether the innermost saved-tensor hooks belong to torch.utils.checkpoint
/// (they are Python objects; the Python bindings install it, and no hooks exist without Python).
void set_checkpoint_hooks_probe(std::function<bool()> probe);

using RecomputeFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs fn(inputs) without keeping its activations; the backward runs it again, with every random
/// stream as it was (RandomState), and differentiates that (reentrant: the gradients of fn's
/// inputs, parameters passed as inputs included, leave this node). Outputs equal fn's, and so do
/// all gradients, dropout in tensor-parallel regions included. fn must take and return tensors
/// only, and read nothing else that changes between the forward and the backward.
///
/// Under the zero-bubble split (split_backward.h) B asks for the activation path's
/// gradients only: the node recomputes once, runs the recomputed graph's B and keeps its weight
/// work, which W then runs. A backward that asks for some inputs' gradients only keeps that work
/// (and the recomputed graph) until the node is freed.
///
/// Traced (torch.compile: inputs with the Python dispatch key, or a fake, proxy or functional
/// mode set), the streams cannot be replayed eagerly: recompute hands fn to the traced form the
/// Python bindings install (torch.utils.checkpoint, under which the per-rank stream's noise is
/// saved rather than recomputed, torch_mp/recompute.py), or, with none installed, just runs it.
std::vector<at::Tensor> recompute(const RecomputeFunction& fn,
                                  const std::vector<at::Tensor>& inputs);

/// The traced form of recompute (see there): called with fn, which it must run inside a
/// RecomputeScope (tracker draws are allowed), and the inputs.
using TracedRecompute = std::function<std::vector<at::Tensor>(const RecomputeFunction& fn,
                                                              const std::vector<at::Tensor>&)>;
void set_traced_recompute(TracedRecompute traced);

}  // namespace torch_mp
