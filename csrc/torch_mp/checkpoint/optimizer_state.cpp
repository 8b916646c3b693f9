#include "torch_mp/checkpoint/optimizer_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>

#include "torch_mp/comm.h"
#include "torch_mp/optim/distributed_optimizer.h"

namespace torch_mp::checkpoint {
namespace {

template <typename State>
ParamState adam_state(const State& state) {
  ParamState out{{{"exp_avg", state.exp_avg()}, {"exp_avg_sq", state.exp_avg_sq()}}, state.step()};
  if (state.max_exp_avg_sq().defined()) {
    out.tensors.emplace_back("max_exp_avg_sq", state.max_exp_avg_sq());
  }
  return out;
}

ParamState state_of(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  const auto found = optimizer.state().find(parameter.unsafeGetTensorImpl());
  if (found == optimizer.state().end()) {
    return {};
  }
  const auto* state = found->second.get();
  if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
    return adam_state(*s);
  }
  if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
    return adam_state(*s);
  }
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
    return {{{"momentum_buffer", s->momentum_buffer()}}, std::nullopt};
  }
  TORCH_CHECK(false,
              "torch_mp::checkpoint: optimizer state of this kind is not supported (Adam, AdamW "
              "and SGD are)");
}

// The state tensor `name` of `state`; undefined if it has none.
at::Tensor named(const ParamState& state, const std::string& name) {
  for (const auto& [key, tensor] : state.tensors) {
    if (key == name) {
      return tensor;
    }
  }
  return {};
}

// The optimizer whose state() holds the tensors: a DistributedOptimizer's local one.
const torch::optim::Optimizer& holder(const torch::optim::Optimizer& optimizer) {
  const auto* zero = dynamic_cast<const optim::DistributedOptimizer*>(&optimizer);
  return zero ? const_cast<optim::DistributedOptimizer*>(zero)->local_optimizer() : optimizer;
}

/// The kind of state `optimizer` keeps, by the names of its tensors: nullopt if unsupported.
std::optional<std::vector<std::string>> state_names(const torch::optim::Optimizer& optimizer) {
  const auto& local = holder(optimizer);
  if (dynamic_cast<const torch::optim::AdamW*>(&local) ||
      dynamic_cast<const torch::optim::Adam*>(&local)) {
    return std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  }
  if (dynamic_cast<const torch::optim::SGD*>(&local)) {
    return std::vector<std::string>{"momentum_buffer"};
  }
  return std::nullopt;
}

void set_state(torch::optim::Optimizer& optimizer,
               const at::Tensor& parameter,
               const std::map<std::string, at::Tensor>& tensors,
               std::optional<int64_t> step) {
  const auto get = [&](const char* name) {
    const auto it = tensors.find(name);
    return it == tensors.end() ? at::Tensor() : it->second;
  };
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  const auto adam = [&](auto made) {
    made->exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq")).step(step.value_or(0));
    made->max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(made);
  };
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    adam(std::make_unique<torch::optim::AdamWParamState>());
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    adam(std::make_unique<torch::optim::AdamParamState>());
  } else {
    auto made = std::make_unique<torch::optim::SGDParamState>();
    made->momentum_buffer(get("momentum_buffer"));
    state = std::move(made);
  }
  optimizer.state()[parameter.unsafeGetTensorImpl()] = std::move(state);
}

// A DistributedOptimizer's state as a plain optimizer's: each state tensor gathered whole from
// the shards, which parameters have state and their steps agreed over the group (a rank may hold
// no element of a parameter).
std::unordered_map<const c10::TensorImpl*, ParamState> gathered_states(
    optim::DistributedOptimizer& zero) {
  const auto& shards = zero.shards();
  const auto& pieces = shards.pieces();
  const auto& parameters = shards.parameters();
  const auto n = static_cast<int64_t>(parameters.size());
  std::vector<ParamState> piece_states;
  // Per parameter: has state (1), its step; -1 where this rank does not know. The last column:
  // whether amsgrad's third moment exists (every rank must gather the same names).
  at::Tensor known = at::full({2, n + 1}, -1, at::kLong);
  auto rows = known.accessor<int64_t, 2>();
  for (size_t s = 0; s < pieces.size(); ++s) {
    piece_states.push_back(state_of(zero.local_optimizer(), shards.shards()[s]));
    const auto& state = piece_states.back();
    const auto p = static_cast<int64_t>(pieces[s].parameter);
    if (!state.tensors.empty()) {
      rows[0][p] = 1;
      rows[1][p] = state.step.value_or(-1);
    }
    if (named(state, "max_exp_avg_sq").defined()) {
      rows[0][n] = 1;
    }
  }
  known = comm::all_reduce(known, shards.group(), c10d::ReduceOp::MAX);
  rows = known.accessor<int64_t, 2>();
  auto names = *state_names(zero);
  if (rows[0][n] == 1) {
    names.emplace_back("max_exp_avg_sq");
  }
  std::unordered_map<const c10::TensorImpl*, ParamState> out;
  for (const auto& name : names) {
    std::vector<at::Tensor> per_shard;
    for (const auto& state : piece_states) {
      per_shard.push_back(named(state, name));
    }
    const auto whole = shards.gather(per_shard);
    for (int64_t p = 0; p < n; ++p) {
      if (rows[0][p] == 1) {
        out[parameters[p].unsafeGetTensorImpl()].tensors.emplace_back(name, whole[p]);
      }
    }
  }
  for (int64_t p = 0; p < n; ++p) {
    if (rows[0][p] == 1 && rows[1][p] >= 0) {
      out[parameters[p].unsafeGetTensorImpl()].step = rows[1][p];
    }
  }
  return out;
}

}  // namespace

std::unordered_map<const c10::TensorImpl*, ParamState> states_by_parameter(
    torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(state_names(optimizer),
              "optimizers of this kind are not supported (Adam, AdamW and SGD are, and a "
              "DistributedOptimizer over one of them)");
  if (auto* zero = dynamic_cast<optim::DistributedOptimizer*>(&optimizer)) {
    return gathered_states(*zero);
  }
  std::unordered_map<const c10::TensorImpl*, ParamState> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto state = state_of(optimizer, p);
      if (!state.tensors.empty()) {
        out[p.unsafeGetTensorImpl()] = std::move(state);
      }
    }
  }
  return out;
}

void check_state_fits(const torch::optim::Optimizer& optimizer,
                      const std::map<std::string, at::Tensor>& tensors,
                      const std::string& name) {
  const auto names = state_names(optimizer);
  TORCH_CHECK(names, "optimizers of this kind are not supported (Adam, AdamW and SGD are)");
  for (const auto& needed : *names) {
    TORCH_CHECK(tensors.count(needed),
                "the checkpoint's optimizer state of ",
                name,
                " has no ",
                needed,
                ": it was saved from another kind of optimizer");
  }
}

void set_states(torch::optim::Optimizer& optimizer, const std::vector<LoadedState>& loaded) {
  auto* zero = dynamic_cast<optim::DistributedOptimizer*>(&optimizer);
  if (!zero) {
    for (const auto& state : loaded) {
      set_state(optimizer, state.parameter, state.tensors, state.step);
    }
    return;
  }
  const auto& shards = zero->shards();
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (size_t p = 0; p < shards.parameters().size(); ++p) {
    index[shards.parameters()[p].unsafeGetTensorImpl()] = p;
  }
  std::vector<const LoadedState*> by_parameter(shards.parameters().size(), nullptr);
  std::vector<std::string> names;
  for (const auto& state : loaded) {
    by_parameter.at(index.at(state.parameter.unsafeGetTensorImpl())) = &state;
    for (const auto& tensor : state.tensors) {
      if (std::find(names.begin(), names.end(), tensor.first) == names.end()) {
        names.push_back(tensor.first);
      }
    }
  }
  std::map<std::string, std::vector<at::Tensor>> sliced;
  for (const auto& name : names) {
    std::vector<at::Tensor> whole;
    for (const auto* state : by_parameter) {
      at::Tensor value;
      if (state) {
        const auto it = state->tensors.find(name);
        value = it == state->tensors.end() ? at::Tensor() : it->second;
      }
      whole.push_back(value);
    }
    sliced[name] = shards.slice(whole);
  }
  for (size_t s = 0; s < shards.pieces().size(); ++s) {
    const auto* state = by_parameter[shards.pieces()[s].parameter];
    if (!state) {
      continue;
    }
    const auto& shard = shards.shards()[s];
    std::map<std::string, at::Tensor> pieces;
    for (const auto& name : names) {
      if (sliced[name][s].defined()) {
        pieces[name] = sliced[name][s].to(shard.scalar_type());
      }
    }
    set_state(zero->local_optimizer(), shard, pieces, state->step);
  }
}

}  // namespace torch_mp::checkpoint
