#pragma once
// The zero-bubble split of a stage's backward into B (input gradients) and W (weight gradients),
// each doing its own share of the work once.
//
//   B  runs the autograd graph from the stage's outputs to its inputs only. Every node on that
//      path computes only the gradients that lead to the inputs (a Linear's matmul node computes
//      dX = dY W, not dW = dY^T X). Where such a node also feeds parameters ("a weight node"),
//      B keeps the gradient arriving at it.
//   W  restarts each weight node from the kept gradient, towards its parameters only: dW = dY^T X
//      and the parameters' accumulation, nothing of the activation-gradient path again.
//
//         out ──> [matmul 2] ──> gelu ──> [matmul 1] ──> x          B: out -> x, keeping the
//                     │                       │                        gradients into [matmul k]
//                     └──> W2                 └──> W1                W: [matmul k] -> Wk
//
// W is one autograd-engine call from all weight nodes at once, their edges back towards the
// inputs cut after B, so that no weight node is reached again through another's input path.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <vector>

namespace torch_mp {

/// What B keeps for W: where W starts (the weight nodes' inputs, and outputs that lead to
/// parameters only), the gradients arriving there, and the parameters' accumulators.
struct WeightWork {
  std::vector<torch::autograd::Edge> roots;
  std::vector<at::Tensor> grads;
  std::vector<torch::autograd::Edge> parameters;
};

/// B: the gradients of `inputs` (leaves that require grad) from those of `outputs`, without
/// computing any gradient of `parameters`; keeps the graph for W. Undefined where an input gets
/// no gradient.
std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& output_grads,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& parameters,
                                       WeightWork& work);

/// W: accumulates the parameters' gradients from what backward_input kept, and frees the graph.
void backward_weight(WeightWork& work);

}  // namespace torch_mp
