#pragma once
// A pipeline stage, and the work of one computation on one (stage, micro-batch): its forward,
// the loss on the last stage, its backward (whole, or split into B and W; split_backward.h),
// and the finiteness check of what they make.
//
// The executor (executor.h) decides when each runs and moves tensors between slots and ranks;
// the functions here only compute, and raise naming the stage, rank, micro-batch and action.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/split_backward.h"

namespace torch_mp::pipeline {

/// A stage: its forward (tensors in, tensors out) and the parameters its W computes gradients of.
struct Stage {
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  std::vector<at::Tensor> parameters;
  /// For a data-parallel stage: arms its gradient reduction. The executor calls it once per
  /// step, right before the stage's last backward that accumulates parameter gradients (its
  /// last W, BW, or the B that runs the whole backward), so that the reduction runs once, over
  /// every micro-batch's gradients, overlapped with that backward. `forward` must not arm it
  /// (a DDP module runs its forwards under no_sync).
  std::function<void()> arm_gradient_sync;
};

/// The loss of the last stage's outputs against a micro-batch's targets (a scalar, averaged over
/// the micro-batch).
using LossFn =
    std::function<at::Tensor(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&)>;

/// What one (stage, micro-batch) holds between its actions.
struct Slot {
  /// Stage inputs (leaves that require grad, in training).
  std::vector<at::Tensor> inputs;
  /// Stage outputs.
  std::vector<at::Tensor> outputs;
  /// Gradients of the outputs, from the next stage.
  std::vector<at::Tensor> output_grads;
  /// Gradients of the inputs, for the previous stage.
  std::vector<at::Tensor> input_grads;
  /// What B kept for W.
  WeightWork weight_work;
  /// B was split: W still has to run.
  bool weight_pending = false;
  /// Last stage: the loss / m, computed from detached copies of the outputs (loss_inputs), so
  /// that backward through the loss runs once, before B, and never again at W (a loss such as
  /// vocab_parallel_cross_entropy turns its saved buffers into the gradient in place).
  at::Tensor loss;
  /// Last stage: the detached copies of the outputs that `loss` was computed from.
  std::vector<at::Tensor> loss_inputs;
};

/// Leaves that stand for a received (or same-rank) stage input, so that backward stops at the
/// stage: `tensors` detached, floating-point ones requiring grad when `train`.
std::vector<at::Tensor> as_stage_inputs(const std::vector<at::Tensor>& tensors, bool train);

/// `stage`'s forward of `inputs` at `a` on `rank`. Raises, if the forward throws, naming the
/// stage, the rank, the micro-batch, the action, the inputs and where they came from.
std::vector<at::Tensor> run_forward(const Stage& stage,
                                    const std::vector<at::Tensor>& inputs,
                                    const Action& a,
                                    const Schedule& schedule,
                                    int64_t rank);

/// `loss` of the last stage's `outputs` against `targets` at `a` on `rank`. Raises, naming the
/// micro-batch, the action, the stage, the rank and the tensors, if the loss throws; raises if
/// it is not a scalar.
at::Tensor run_loss(const LossFn& loss,
                    const std::vector<at::Tensor>& outputs,
                    const std::vector<at::Tensor>& targets,
                    const Action& a,
                    int64_t rank);

/// The gradients of slot.loss with respect to the last stage's outputs, one per output (zeros
/// where the loss has none). Drops the loss and its inputs from `slot`.
std::vector<at::Tensor> loss_gradients(Slot& slot);

/// The backward of `slot` from `grads`, the gradients of its outputs (empty: autograd's implicit
/// ones, for scalar outputs). With `full`, or on a stage whose inputs take no gradient (the
/// first), the whole backward; otherwise B, keeping in the slot what W needs. Calls
/// `before_accumulating` right before a backward that accumulates parameter gradients. Sets
/// slot.input_grads (zeros where an input gets none); drops the outputs and their gradients.
void run_backward(Slot& slot,
                  const std::vector<at::Tensor>& grads,
                  bool full,
                  const std::vector<at::Tensor>& parameters,
                  const std::function<void()>& before_accumulating);

/// W: accumulates the parameters' gradients from what B kept in `slot`, if B left W any work,
/// calling `before_accumulating` first.
void run_weight(Slot& slot, const std::function<void()>& before_accumulating);

/// Raises unless every defined floating-point tensor of `tensors` is finite, naming the stage,
/// `what` (its output, loss, input gradient) and its index, the micro-batch, the action, `rank`
/// and the counts of NaN and infinite entries.
void require_finite(const std::vector<at::Tensor>& tensors,
                    const Action& a,
                    const char* what,
                    int64_t rank);

}  // namespace torch_mp::pipeline
