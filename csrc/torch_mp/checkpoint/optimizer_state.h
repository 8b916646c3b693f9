#pragma once
// How a checkpoint reads and writes a LibTorch optimizer's state, parameter by parameter, in the
// names the Python optimizers use (checkpoint.h): Adam and AdamW (exp_avg, exp_avg_sq,
// max_exp_avg_sq with amsgrad, step) and SGD (momentum_buffer); and a DistributedOptimizer over
// one of them, whose state is gathered whole from the data ranks' shards when saved, and of which
// each rank keeps its shards' part when loaded, so that its checkpoints are a plain optimizer's.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_mp::checkpoint {

/// The state of one parameter: its tensors by name (shaped as the parameter), its step count.
struct ParamState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::optional<int64_t> step;
};

/// Every parameter's state (those without any are absent). For a DistributedOptimizer gathered
/// from the data ranks: collective over its group. Raises for optimizers of other kinds.
std::unordered_map<const c10::TensorImpl*, ParamState> states_by_parameter(
    torch::optim::Optimizer& optimizer);

/// Raises unless saved state `tensors` of parameter `name` fit `optimizer`'s kind.
void check_state_fits(const torch::optim::Optimizer& optimizer,
                      const std::map<std::string, at::Tensor>& tensors,
                      const std::string& name);

/// State read from a checkpoint for one parameter.
struct LoadedState {
  at::Tensor parameter;
  std::map<std::string, at::Tensor> tensors;
  std::optional<int64_t> step;
};

/// Replaces the state of the parameters of `loaded` (checked by check_state_fits); a
/// DistributedOptimizer keeps this rank's shards' part. Not collective.
void set_states(torch::optim::Optimizer& optimizer, const std::vector<LoadedState>& loaded);

}  // namespace torch_mp::checkpoint
