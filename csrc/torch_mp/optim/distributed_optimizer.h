#pragma once
// torch_mp::DistributedOptimizer: a LibTorch optimizer whose state is sharded over the
// data-parallel group (ZeRO-1, as Megatron's distributed optimizer), the C++ face of
// torch_mp.DistributedOptimizer.
//
//   torch_mp::DataParallel model(net);                       // gradients averaged over dp
//   torch_mp::DistributedOptimizer optimizer(model->parameters(),
//                                            torch::optim::AdamWOptions(1e-3));
//   loss.backward();
//   optimizer.step();    // this rank steps its 1/dp of the elements, then all are all-gathered
//
// It is a torch::optim::Optimizer over the whole parameters (param_groups, zero_grad and the
// learning-rate schedulers work on it as on any); the optimizer that steps, and holds the state
// (1/dp of a plain one's), is local_optimizer(), over this rank's shards (ParameterShards). The
// update is elementwise, so only optimizers whose update of an element reads that element alone
// are offered: Adam, AdamW, SGD, Adagrad, RMSprop (not LBFGS).

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <vector>

#include "torch_mp/optim/parameter_shards.h"

namespace torch_mp::optim {

/// Options of DistributedOptimizer.
struct DistributedOptimizerOptions {
  /// The data-parallel group; the default mesh's dp_cp_group (its data group, times the
  /// context group when cp > 1: parameters are replicated over both) when null.
  TORCH_ARG(GroupPtr, group) = {};
  /// Size of a flat bucket of the all-gather, in MiB.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Step fp32 (or other) master copies of the parameters' shards, written back rounded.
  TORCH_ARG(std::optional<at::ScalarType>, master_dtype) = std::nullopt;
  /// Return from step() with the parameters' all-gather still running, overlapped with what
  /// comes next; torch_mp::DataParallel's forward waits for it (ParameterShardsOptions).
  TORCH_ARG(bool, overlap_param_gather) = false;
  /// The sharded state of the DataParallel(shard_gradients, grad_dtype or shard_parameters)
  /// whose parameters these are: DataParallel::sharded_state(). Null: found from the
  /// parameters (their one owner, data_parallel/owners.h).
  TORCH_ARG(std::shared_ptr<data_parallel::ShardedState>, sharded_state) = {};
};

/// The LibTorch optimizer of an options type (AdamWOptions -> AdamW, ...).
template <typename Options>
struct LocalOptimizer;  // only elementwise optimizers are defined below
template <>
struct LocalOptimizer<torch::optim::AdamOptions> {
  using type = torch::optim::Adam;
};
template <>
struct LocalOptimizer<torch::optim::AdamWOptions> {
  using type = torch::optim::AdamW;
};
template <>
struct LocalOptimizer<torch::optim::SGDOptions> {
  using type = torch::optim::SGD;
};
template <>
struct LocalOptimizer<torch::optim::AdagradOptions> {
  using type = torch::optim::Adagrad;
};
template <>
struct LocalOptimizer<torch::optim::RMSpropOptions> {
  using type = torch::optim::RMSprop;
};

/// An optimizer whose state is sharded over the data-parallel ranks (see the top of the file).
class DistributedOptimizer : public torch::optim::Optimizer {
 public:
  /// Over parameter groups (each may carry its own options, as for any LibTorch optimizer);
  /// `defaults`' type picks the local optimizer (AdamWOptions: AdamW). Collective over the
  /// group: raises on every rank if the ranks' parameters differ.
  template <typename Options>
  DistributedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                       const Options& defaults,
                       DistributedOptimizerOptions options = {})
      : torch::optim::Optimizer(param_groups, std::make_unique<Options>(defaults)) {
    build(options, [&defaults](const std::vector<torch::optim::OptimizerParamGroup>& local) {
      return std::make_unique<typename LocalOptimizer<Options>::type>(local, defaults);
    });
  }
  /// Over one group of parameters.
  template <typename Options>
  DistributedOptimizer(std::vector<at::Tensor> parameters,
                       const Options& defaults,
                       DistributedOptimizerOptions options = {})
      : DistributedOptimizer(
            std::vector<torch::optim::OptimizerParamGroup>{
                torch::optim::OptimizerParamGroup(std::move(parameters))},
            defaults,
            std::move(options)) {}

  /// Copies every group's options (its learning rate, as a scheduler set it) to the local
  /// optimizer, steps this rank's shards with the averaged gradients, and all-gathers the
  /// updated parameters. Collective over the group.
  at::Tensor step(LossClosure closure = nullptr) override;

  /// Zeros the parameters' gradients, as any optimizer, and drops the reduced and main
  /// gradients a DataParallel(shard_gradients=True or grad_dtype) holds for them. (Through a
  /// torch::optim::Optimizer&, the base's zero_grad runs: reduced gradients are dropped after
  /// every step anyway, and the DataParallel's zero_grad drops the main gradients too.)
  void zero_grad(bool set_to_none = true);

  /// Waits for the all-gather an overlapping step left running: before reading the
  /// parameters outside a DataParallel's forward.
  void wait_for_parameters() const { shards_->wait_for_parameters(); }

  /// The optimizer over this rank's shards, which holds its state.
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  /// How the parameters are cut over the group.
  const ParameterShards& shards() const { return *shards_; }

 private:
  using MakeLocal = std::function<std::unique_ptr<torch::optim::Optimizer>(
      const std::vector<torch::optim::OptimizerParamGroup>&)>;
  void build(const DistributedOptimizerOptions& options, const MakeLocal& make_local);

  std::unique_ptr<ParameterShards> shards_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

}  // namespace torch_mp::optim

namespace torch_mp {
using optim::DistributedOptimizer;
using optim::DistributedOptimizerOptions;
}  // namespace torch_mp
