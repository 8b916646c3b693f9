#pragma once
// Pipeline: the front door of the pipeline engine, for C++ applications and (through the
// bindings) for torch_mp.pipeline.Pipeline. Makes the schedule, cuts batches into micro-batches
// and runs the Executor.

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/data_parallel/data_parallel.h"
#include "torch_mp/pipeline/executor.h"

namespace torch_mp::pipeline {

/// Options of Pipeline.
struct PipelineOptions {
  /// A schedule name: "gpipe", "1f1b", "interleaved_1f1b", "zb_h1".
  TORCH_ARG(std::string, schedule) = "1f1b";
  /// Micro-batches per step; batch sizes must be divisible by it.
  TORCH_ARG(int64_t, num_microbatches) = 1;
  /// The pipeline group; the default mesh's pp_group when null.
  TORCH_ARG(GroupPtr, group) = {};
};

/// A stage made of a torch::nn::Sequential (one tensor in, one tensor out).
Stage stage_of(torch::nn::Sequential module);

/// A data-parallel stage (one tensor in, one tensor out; the wrapped module given as a holder):
/// its forwards run under no_sync, and the executor arms the reduction before the stage's last
/// backward of each step, so gradients are averaged over the data group once per step.
Stage stage_of(data_parallel::DataParallel module);

/// A data-parallel stage whose forward is `forward` (any tensors in and out, e.g. a method of the
/// wrapped module taking several), run as the one-tensor stage's is: after the module's
/// prepare_for_forward, without arming the reduction, which the executor arms once per step.
Stage stage_of(data_parallel::DataParallel module,
               std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward);

/// Pipeline-parallel training of this rank's stages.
///
/// Every rank of the pipeline group builds one with its own stages (Schedule::stages_of_rank, in
/// increasing order: stages r, r + p, ... of p ranks, or r and 2p - 1 - r for zbv's V) and calls
/// `step` together: the rank holding the first stage passes the batch, the rank holding the last
/// stage the targets. Gradients accumulate into the stages' parameters and equal those of the
/// unpipelined model with the loss averaged over the batch.
class Pipeline {
 public:
  /// Generates the schedule named in `options` for group size x stages.size() stages.
  Pipeline(std::vector<Stage> stages, LossFn loss, PipelineOptions options = {});
  /// Runs a given schedule (e.g. one read from a file) over `group` (default mesh's when null).
  Pipeline(std::vector<Stage> stages, LossFn loss, Schedule schedule, GroupPtr group = {});

  /// One training step. Returns the mean micro-batch loss on the last stage's rank.
  std::optional<at::Tensor> step(const std::vector<at::Tensor>& inputs = {},
                                 const std::vector<at::Tensor>& targets = {});
  /// Forward only: on the last stage's rank, the outputs (micro-batches concatenated) and the
  /// mean loss if `targets` are given.
  std::pair<std::vector<at::Tensor>, std::optional<at::Tensor>> eval_step(
      const std::vector<at::Tensor>& inputs = {}, const std::vector<at::Tensor>& targets = {});

  /// Ties `parameters` of the first stage to as many of the last stage (e.g. the input
  /// embedding and the output head): each rank holding the first or the last stage passes its
  /// own, in the same order; other ranks pass none. Copies the first stage's values to the last
  /// stage's, marks the last stage's as tied copies (norms count them once), and after every step
  /// sums their gradients over `embedding_group` (the default mesh's when null), so that both
  /// copies stay equal (gradients a DataParallel(shard_gradients=True) reduce-scattered are put
  /// together over its data group first, and each rank keeps its pieces of the sum). Raises if
  /// the ranks' lists differ in length or shapes, or if one rank holds both stages (share one
  /// parameter there instead).
  void tie_parameters(std::vector<at::Tensor> parameters, GroupPtr embedding_group = {});

  /// Makes the pipeline usable again after a step that failed (on any rank); every rank of the
  /// pipeline calls it. A timeout or a lost connection leaves Gloo's pairs closed, so the
  /// pipeline moves to a fresh Gloo group of the same ranks, made over `store` under keys in
  /// `key` (the same on the pipeline's ranks, and different for every pipeline group); without
  /// them, over the default mesh's store for its pipeline group. The next step is exact:
  /// nothing of the failed step's messages is taken for it.
  void reset(const StorePtr& store = {}, const std::string& key = {});

  /// Checks every stage output, loss and input gradient for NaN and Inf (Executor).
  void set_check_finite(bool on) { executor_->set_check_finite(on); }

  /// The schedule being run (made NCCL-safe under NCCL's rules).
  const Schedule& schedule() const { return executor_->schedule(); }
  /// Whether it runs under NCCL's rules: an NCCL group, or TORCH_MP_CHECK_COLLECTIVES=1 (Executor).
  bool ordered() const { return executor_->ordered(); }
  /// This rank's actions in the last step, with wall-clock times in seconds.
  const std::vector<TimedAction>& trace() const { return executor_->trace(); }
  /// Every pipeline rank's trace of the last step, on the pipeline group's first rank (nullopt
  /// on the others): a collective over the pipeline group. Each rank's times count from its own
  /// start of the step.
  std::optional<std::vector<TimedAction>> gathered_trace() const;

 private:
  std::vector<std::vector<at::Tensor>> split(const std::vector<at::Tensor>& batch) const;
  std::unique_ptr<Executor> executor_;
  std::vector<at::Tensor> tied_;
  GroupPtr embedding_group_;
  int64_t resets_ = 0;
};

}  // namespace torch_mp::pipeline
