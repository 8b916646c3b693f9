#include "torch_mp/recompute.h"

#include <ATen/Context.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>

#include "torch_mp/random.h"
#include "torch_mp/split_backward.h"

namespace torch_mp {

// ---- the random streams ----------------------------------------------------------------------

RandomState RandomState::capture(const std::vector<c10::Device>& devices) {
  RandomState state;
  std::vector<c10::Device> all{c10::kCPU};
  for (const auto& device : devices) {
    if (std::find(all.begin(), all.end(), device) == all.end()) {
      all.push_back(device);
    }
  }
  for (const auto& device : all) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    state.generators_.emplace_back(device, generator.get_state());
  }
  state.tracker_ = rng_tracker().states();
  return state;
}

void RandomState::restore() const {
  for (const auto& [device, saved] : generators_) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(saved);
  }
  rng_tracker().set_states(tracker_);
}

// ---- where a tracker draw is safe ------------------------------------------------------------

namespace {

// The saved-tensor hooks depth of the innermost RecomputeScope on this thread; -1: none.
thread_local std::ptrdiff_t scope_depth = -1;

std::ptrdiff_t hooks_depth() {
  return static_cast<std::ptrdiff_t>(at::SavedTensorDefaultHooks::get_tls_state().stack.size());
}

std::mutex probe_mutex;
std::function<bool()> checkpoint_probe;

bool under_torch_checkpoint() {
  std::function<bool()> probe;
  {
    std::lock_guard<std::mutex> lock(probe_mutex);
    probe = checkpoint_probe;
  }
  return probe && probe();
}

constexpr const char* kUseRecompute =
    "; it restores the default generators only, so the recomputed forward would draw other "
    "dropout masks and the gradients would be wrong. Use torch_mp.recompute (C++: "
    "torch_mp::recompute), which replays the per-rank stream too";

}  // namespace

RecomputeScope::RecomputeScope() : saved_depth_(scope_depth) { scope_depth = hooks_depth(); }

RecomputeScope::~RecomputeScope() { scope_depth = saved_depth_; }

void check_recomputable_draw() {
  const auto depth = hooks_depth();
  if (scope_depth == depth) {
    return;
  }
  TORCH_CHECK(depth == 0 || !under_torch_checkpoint(),
              "torch_mp: dropout inside a tensor-parallel region (drawn from the per-rank stream "
              "of torch_mp.random) under torch.utils.checkpoint",
              kUseRecompute);
  TORCH_CHECK(!(torch::autograd::get_current_graph_task_id() != -1 && at::GradMode::is_enabled()),
              "torch_mp: dropout inside a tensor-parallel region (drawn from the per-rank stream "
              "of torch_mp.random) run again inside a backward pass, as a reentrant "
              "torch.utils.checkpoint (use_reentrant=True) recomputes",
              kUseRecompute);
}

void set_checkpoint_hooks_probe(std::function<bool()> probe) {
  std::lock_guard<std::mutex> lock(probe_mutex);
  checkpoint_probe = std::move(probe);
}

// ---- recompute -------------------------------------------------------------------------------

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs besides the inputs: the function, the streams it started from, and,
// between a zero-bubble B and W, the recomputed graph's weight work (split_backward.h).
struct Replay : torch::CustomClassHolder {
  RecomputeFunction fn;
  RandomState state;
  std::optional<WeightWork> weight_work;
  variable_list weight_leaves;  // the recomputed graph's leaves W accumulates into
};

std::vector<c10::Device> devices_of(const variable_list& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (t.defined() && !t.device().is_cpu()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

// fn again on fresh leaves standing for `saved`, from the streams it first started from; then
// the streams as they are now come back (other forwards may have drawn since).
std::pair<variable_list, variable_list> run_again(const Replay& replay,
                                                  const variable_list& saved) {
  variable_list leaves;
  for (const auto& t : saved) {
    leaves.push_back(t.detach().requires_grad_(t.requires_grad()));
  }
  const auto now = RandomState::capture(devices_of(leaves));
  variable_list outputs;
  try {
    replay.state.restore();
    RecomputeScope scope;
    torch::autograd::AutoGradMode grad_mode(true);
    outputs = replay.fn(leaves);
  } catch (...) {
    now.restore();
    throw;
  }
  now.restore();
  return {std::move(leaves), std::move(outputs)};
}

struct Recompute : torch::autograd::Function<Recompute> {
  static variable_list forward(AutogradContext* ctx,
                               const RecomputeFunction& fn,
                               at::TensorList tensors) {
    const auto inputs = tensors.vec();
    auto replay = c10::make_intrusive<Replay>();
    replay->fn = fn;
    replay->state = RandomState::capture(devices_of(inputs));
    variable_list outputs;
    {
      RecomputeScope scope;
      outputs = fn(inputs);
    }
    ctx->save_for_backward(inputs);
    ctx->saved_data["replay"] = c10::IValue::make_capsule(std::move(replay));
    return outputs;
  }

  // A plain backward asks for every input's gradient. The zero-bubble split asks in two calls:
  // B for the inputs on the activation path only, then W (the same gradients, the edges towards
  // the activations cut) for the rest. B then recomputes and runs the recomputed graph's B,
  // keeping its weight work; W runs that work: one recomputation, each gradient computed once.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& replay =
        *c10::static_intrusive_pointer_cast<Replay>(ctx->saved_data["replay"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<bool> wanted(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      wanted[i] = saved[i].requires_grad() && ctx->needs_input_grad(i);
    }
    variable_list result(saved.size() + 1);  // result[0]: fn's
    if (replay.weight_work) {                // W after B
      backward_weight(*replay.weight_work);
      replay.weight_work.reset();
      for (size_t i = 0; i < saved.size(); ++i) {
        if (wanted[i]) {
          result[i + 1] = replay.weight_leaves[i].grad();
        }
      }
      replay.weight_leaves.clear();
      return result;
    }
    auto [leaves, outputs] = run_again(replay, saved);
    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (roots.empty()) {
      return result;
    }
    variable_list now, later;
    for (size_t i = 0; i < saved.size(); ++i) {
      if (saved[i].requires_grad()) {
        (wanted[i] ? now : later).push_back(leaves[i]);
      }
    }
    torch::autograd::AutoGradMode grad_mode(true);
    if (later.empty()) {
      torch::autograd::backward(roots, root_grads);
    } else {
      WeightWork work;
      const auto input_grads = backward_input(roots, root_grads, now, later, work);
      for (size_t i = 0, j = 0; i < saved.size(); ++i) {
        if (wanted[i]) {
          leaves[i].mutable_grad() = input_grads[j++];
        }
      }
      replay.weight_work = std::move(work);
      replay.weight_leaves = leaves;
    }
    for (size_t i = 0; i < saved.size(); ++i) {
      if (wanted[i]) {
        result[i + 1] = leaves[i].grad();
      }
    }
    return result;
  }
};

std::mutex traced_mutex;
TracedRecompute traced_recompute;

// Whether the inputs are being traced rather than computed: torch.compile's fake and functional
// tensors are Python tensors, and its tracers the fake, proxy and functional modes. (Other
// dispatch modes, a memory counter say, see real tensors computed.)
bool traced(const variable_list& inputs) {
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  for (const auto key : {TorchDispatchModeKey::FAKE,
                         TorchDispatchModeKey::PROXY,
                         TorchDispatchModeKey::FUNCTIONAL}) {
    if (TorchDispatchModeTLS::get_mode(key).has_value()) {
      return true;
    }
  }
  return std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) {
    return t.defined() && t.key_set().has(c10::DispatchKey::Python);
  });
}

}  // namespace

void set_traced_recompute(TracedRecompute traced) {
  std::lock_guard<std::mutex> lock(traced_mutex);
  traced_recompute = std::move(traced);
}

std::vector<at::Tensor> recompute(const RecomputeFunction& fn,
                                  const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(fn, "torch_mp::recompute: no function");
  const bool any_grad = std::any_of(
      inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  if (!at::GradMode::is_enabled()) {
    return fn(inputs);  // nothing to differentiate, nothing to keep
  }
  if (!any_grad) {
    // The node would have no inputs to hang on, and the parameters inside fn no gradients.
    TORCH_WARN_ONCE(
        "torch_mp::recompute: no input requires grad, so the function runs without "
        "recomputation (its activations are kept)");
    return fn(inputs);
  }
  if (traced(inputs)) {
    TracedRecompute form;
    {
      std::lock_guard<std::mutex> lock(traced_mutex);
      form = traced_recompute;
    }
    if (form) {
      return form(fn, inputs);
    }
    RecomputeScope scope;
    return fn(inputs);
  }
  return Recompute::apply(fn, at::TensorList(inputs));
}

}  // namespace torch_mp
