// The computations of one action on one (stage, micro-batch): forward, loss, backward, W
// (stage.h).

#include "torch_mp/pipeline/stage.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <sstream>

#include "torch_mp/pipeline/failure.h"
#include "torch_mp/pipeline/microbatches.h"

namespace torch_mp::pipeline {
namespace {

// The gradient of each input (zeros where autograd produced none), as the previous stage
// expects one per tensor it sent.
std::vector<at::Tensor> input_gradients(const std::vector<at::Tensor>& inputs,
                                        const std::vector<at::Tensor>& computed) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& g = computed[i];
    grads.push_back(g.defined() ? g : at::zeros_like(inputs[i]));
  }
  return grads;
}

// The indices of the tensors that require grad.
std::vector<size_t> requiring_grad(const std::vector<at::Tensor>& tensors) {
  std::vector<size_t> indices;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].requires_grad()) {
      indices.push_back(i);
    }
  }
  return indices;
}

}  // namespace

std::vector<at::Tensor> as_stage_inputs(const std::vector<at::Tensor>& tensors, bool train) {
  std::vector<at::Tensor> leaves;
  for (const auto& t : tensors) {
    auto leaf = t.detach();
    if (train && leaf.is_floating_point()) {
      leaf.requires_grad_(true);
    }
    leaves.push_back(leaf);
  }
  return leaves;
}

std::vector<at::Tensor> run_forward(const Stage& stage,
                                    const std::vector<at::Tensor>& inputs,
                                    const Action& a,
                                    const Schedule& schedule,
                                    int64_t rank) {
  std::vector<at::Tensor> outputs;
  try {
    outputs = stage.forward(inputs);
  } catch (const std::exception& e) {
    std::ostringstream from;
    if (a.stage > 0) {
      from << " from stage " << a.stage - 1 << " (rank " << schedule.rank_of_stage(a.stage - 1)
           << ")";
    }
    TORCH_CHECK(false,
                "Pipeline: stage ",
                a.stage,
                " (rank ",
                rank,
                ") failed on micro-batch ",
                a.microbatch,
                " in ",
                a.to_string(),
                " given ",
                describe_tensors(inputs),
                from.str(),
                ": ",
                text_of(e));
  }
  return outputs;
}

at::Tensor run_loss(const LossFn& loss,
                    const std::vector<at::Tensor>& outputs,
                    const std::vector<at::Tensor>& targets,
                    const Action& a,
                    int64_t rank) {
  at::Tensor value;
  try {
    value = loss(outputs, targets);
  } catch (const std::exception& e) {
    TORCH_CHECK(false,
                "Pipeline: loss_fn failed on micro-batch ",
                a.microbatch,
                " in ",
                a.to_string(),
                " (last stage ",
                a.stage,
                ", rank ",
                rank,
                ") given ",
                describe_tensors(outputs),
                " and targets ",
                describe_tensors(targets),
                ": ",
                text_of(e));
  }
  TORCH_CHECK(value.numel() == 1,
              "Pipeline: the loss function must return a scalar, got shape ",
              value.sizes());
  return value;
}

std::vector<at::Tensor> loss_gradients(Slot& slot) {
  std::vector<at::Tensor> wrt;
  for (const size_t i : requiring_grad(slot.loss_inputs)) {
    wrt.push_back(slot.loss_inputs[i]);
  }
  std::vector<at::Tensor> computed;
  if (!wrt.empty() && slot.loss.requires_grad()) {
    computed = torch::autograd::grad({slot.loss},
                                     wrt,
                                     /*grad_outputs=*/{},
                                     /*retain_graph=*/false,
                                     /*create_graph=*/false,
                                     /*allow_unused=*/true);
  }
  std::vector<at::Tensor> grads(slot.loss_inputs.size());
  for (size_t i = 0, j = 0; i < slot.loss_inputs.size(); ++i) {
    if (slot.loss_inputs[i].requires_grad() && j < computed.size()) {
      grads[i] = computed[j++];
    }
  }
  slot.loss = at::Tensor();
  slot.loss_inputs.clear();
  return input_gradients(slot.outputs, grads);
}

void run_backward(Slot& slot,
                  const std::vector<at::Tensor>& grads,
                  bool full,
                  const std::vector<at::Tensor>& parameters,
                  const std::function<void()>& before_accumulating) {
  // Only outputs that take part in autograd get a gradient.
  std::vector<at::Tensor> outs;
  std::vector<at::Tensor> out_grads;
  for (const size_t i : requiring_grad(slot.outputs)) {
    outs.push_back(slot.outputs[i]);
    if (!grads.empty()) {
      out_grads.push_back(grads.at(i));
    }
  }
  const std::vector<size_t> leaf_index = requiring_grad(slot.inputs);
  std::vector<at::Tensor> leaves;
  for (const size_t i : leaf_index) {
    leaves.push_back(slot.inputs[i]);
  }
  std::vector<at::Tensor> computed(slot.inputs.size());
  // Without input gradients to produce (the first stage), a split B has nothing of its own to
  // do and W would walk the whole graph; running the whole backward at B leaves W nothing.
  if (full || leaves.empty()) {
    if (!outs.empty()) {
      before_accumulating();
      torch::autograd::backward(outs, out_grads);
    }
    for (size_t j = 0; j < leaves.size(); ++j) {
      computed[leaf_index[j]] = leaves[j].grad();
    }
  } else if (!outs.empty()) {
    // B: the input gradients only; what W needs is kept in the slot.
    const auto g = backward_input(outs, out_grads, leaves, parameters, slot.weight_work);
    for (size_t j = 0; j < leaves.size(); ++j) {
      computed[leaf_index[j]] = g[j];
    }
    slot.weight_pending = true;
  }
  slot.outputs.clear();
  slot.output_grads.clear();
  slot.input_grads = input_gradients(slot.inputs, computed);
}

void run_weight(Slot& slot, const std::function<void()>& before_accumulating) {
  if (!slot.weight_pending) {
    return;
  }
  before_accumulating();
  backward_weight(slot.weight_work);
  slot.weight_pending = false;
}

void require_finite(const std::vector<at::Tensor>& tensors,
                    const Action& a,
                    const char* what,
                    int64_t rank) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined() || !t.is_floating_point() || at::isfinite(t).all().item<bool>()) {
      continue;
    }
    const auto nans = at::isnan(t).sum().item<int64_t>();
    TORCH_CHECK(false,
                "Pipeline: non-finite values in stage ",
                a.stage,
                "'s ",
                what,
                " ",
                i,
                " (",
                t.scalar_type(),
                t.sizes(),
                ") of micro-batch ",
                a.microbatch,
                " at ",
                a.to_string(),
                " on rank ",
                rank,
                ": ",
                nans,
                " NaN and ",
                t.numel() - nans - at::isfinite(t).sum().item<int64_t>(),
                " infinite entries (check_finite)");
  }
}

}  // namespace torch_mp::pipeline
