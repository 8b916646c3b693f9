#include "torch_mp/random.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

#include "torch_mp/recompute.h"

namespace torch_mp {
namespace {

at::Generator default_generator(c10::Device device) {
  return at::globalContext().defaultGenerator(device);
}

}  // namespace

void RngTracker::add(const std::string& name, uint64_t seed, c10::Device device) {
  // A stream's first state is the default generator's state right after seeding it.
  auto generator = default_generator(device);
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    const auto saved = generator.get_state();
    generator.set_current_seed(seed);
    state = generator.get_state();
    generator.set_state(saved);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  states_[{name, device.str()}] = state;
}

bool RngTracker::has(const std::string& name, c10::Device device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return states_.count({name, device.str()}) > 0;
}

void RngTracker::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  states_.clear();
}

RngTracker::States RngTracker::states() const {
  std::lock_guard<std::mutex> lock(mutex_);
  States copy;
  for (const auto& [key, state] : states_) {
    copy.emplace(key, state.clone());
  }
  return copy;
}

void RngTracker::set_states(States states) {
  std::lock_guard<std::mutex> lock(mutex_);
  states_ = std::move(states);
}

at::Tensor RngTracker::swap_in(const std::string& name, c10::Device device) {
  at::Tensor stream;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = states_.find({name, device.str()});
    TORCH_CHECK(it != states_.end(),
                "torch_mp.random: no stream '",
                name,
                "' on ",
                device.str(),
                "; seed it first (torch_mp.random.manual_seed or RngTracker::add)");
    stream = it->second;
  }
  auto generator = default_generator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto saved = generator.get_state();
  generator.set_state(stream);
  return saved;
}

void RngTracker::swap_out(const std::string& name,
                          c10::Device device,
                          const at::Tensor& default_state) {
  auto generator = default_generator(device);
  at::Tensor advanced;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    advanced = generator.get_state();
    generator.set_state(default_state);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  states_[{name, device.str()}] = advanced;
}

RngTracker::Fork::Fork(RngTracker& tracker, std::string name, c10::Device device)
    : tracker_(tracker), name_(std::move(name)), device_(device) {
  default_state_ = tracker_.swap_in(name_, device_);
}

RngTracker::Fork::~Fork() { tracker_.swap_out(name_, device_, default_state_); }

RngTracker& rng_tracker() {
  static RngTracker tracker;
  return tracker;
}

void model_parallel_manual_seed(uint64_t seed, const GroupPtr& group, c10::Device device) {
  TORCH_CHECK(group, "torch_mp.random.manual_seed: no tensor-parallel group");
  auto generator = default_generator(device);
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
  rng_tracker().add(kModelParallelRng, seed + 2718 + group->getRank(), device);
}

// ---- dropout in tensor-parallel regions ------------------------------------------------------

namespace {

// The scaled keep-mask of dropout with probability p, drawn as at::dropout draws it on the CPU
// (bernoulli(1 - p) into a tensor like x, divided by 1 - p), from the per-rank stream.
at::Tensor region_dropout_noise(const at::Tensor& x, double p) {
  std::optional<RngTracker::Fork> fork;
  if (rng_tracker().has(kModelParallelRng, x.device())) {
    check_recomputable_draw();
    fork.emplace(rng_tracker(), kModelParallelRng, x.device());
  }
  auto noise = at::empty_like(x);
  noise.bernoulli_(1 - p);
  return noise.div_(1 - p);
}

at::Tensor region_dropout_noise_meta(const at::Tensor& x, double) { return at::empty_like(x); }

}  // namespace

at::Tensor region_dropout(const at::Tensor& x, double p, bool training) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (!training || p == 0.0) {
    return x;
  }
  if (p == 1.0) {
    return x * at::zeros({}, x.options());
  }
  static const auto noise = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("torch_mp::region_dropout_noise", "")
                                .typed<at::Tensor(const at::Tensor&, double)>();
  return x * noise.call(x, p);
}

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def("region_dropout(Tensor x, float p, bool training) -> Tensor", &region_dropout);
  // Its kernel draws random numbers: torch.compile must neither recompute nor reorder it.
  m.def("region_dropout_noise(Tensor x, float p) -> Tensor", {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("region_dropout_noise", &region_dropout_noise);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("region_dropout_noise", &region_dropout_noise_meta);
}

// The mask depends on x's shape only: nothing to differentiate.
TORCH_LIBRARY_IMPL(torch_mp, Autograd, m) {
  m.impl("region_dropout_noise", torch::CppFunction::makeFallthrough());
}

}  // namespace torch_mp
