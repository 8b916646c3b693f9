#include "torch_mp/split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>
#include <unordered_set>

namespace torch_mp {
namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
namespace impl = torch::autograd::impl;

// What a node of the graph leads to.
struct Reach {
  bool input = false;
  bool parameter = false;
};

// The graph below `roots`, each node with what it leads to, nodes listed children first (a
// deterministic order: the same graph gives the same order on every rank, which matters when W
// runs collectives, e.g. a sequence-parallel LayerNorm's weight gradient all-reduce).
struct Graph {
  std::unordered_map<const Node*, Reach> reach;
  std::vector<Node*> order;

  Graph(const edge_list& roots,
        const std::unordered_set<const Node*>& inputs,
        const std::unordered_set<const Node*>& parameters) {
    std::vector<std::pair<Node*, uint32_t>> stack;
    for (const auto& root : roots) {
      Node* node = root.function.get();
      if (node == nullptr || reach.count(node)) {
        continue;
      }
      reach[node];
      stack.emplace_back(node, 0);
      while (!stack.empty()) {
        auto& [current, next] = stack.back();
        if (next < current->num_outputs()) {
          Node* child = current->next_edge(next++).function.get();
          if (child != nullptr && !reach.count(child)) {
            reach[child];
            stack.emplace_back(child, 0);
          }
          continue;
        }
        Reach r{inputs.count(current) > 0, parameters.count(current) > 0};
        for (const auto& edge : current->next_edges()) {
          if (const Node* child = edge.function.get()) {
            r.input |= reach.at(child).input;
            r.parameter |= reach.at(child).parameter;
          }
        }
        reach[current] = r;
        order.push_back(current);
        stack.pop_back();
      }
    }
  }

  // Leads to parameters but to no input: the part of the graph only W needs.
  bool weight_only(const Node* node) const {
    const auto& r = reach.at(node);
    return r.parameter && !r.input;
  }
};

std::unordered_map<const Node*, Edge> accumulators_of(const std::vector<at::Tensor>& tensors) {
  std::unordered_map<const Node*, Edge> out;
  for (const auto& t : tensors) {
    if (t.requires_grad()) {
      if (auto accumulator = impl::try_get_grad_accumulator(t)) {
        const Node* key = accumulator.get();
        out.emplace(key, Edge(std::move(accumulator), 0));
      }
    }
  }
  return out;
}

std::unordered_set<const Node*> keys_of(const std::unordered_map<const Node*, Edge>& edges) {
  std::unordered_set<const Node*> keys;
  for (const auto& [node, edge] : edges) {
    keys.insert(node);
  }
  return keys;
}

}  // namespace

std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& output_grads,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& parameters,
                                       WeightWork& work) {
  edge_list roots;
  for (const auto& out : outputs) {
    roots.push_back(impl::gradient_edge(out));
  }
  const auto input_edges = accumulators_of(inputs);
  const auto parameter_edges = accumulators_of(parameters);
  const auto parameter_nodes = keys_of(parameter_edges);
  const Graph graph(roots, keys_of(input_edges), parameter_nodes);

  // Where W starts: nodes on the input path that also feed parameters ("weight nodes"), and
  // outputs whose whole graph leads to parameters only.
  edge_list captures;
  std::vector<Node*> weight_nodes;
  for (Node* node : graph.order) {
    if (!graph.reach.at(node).input) {
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function && graph.weight_only(edge.function.get())) {
        weight_nodes.push_back(node);
        for (uint32_t k = 0; k < node->num_inputs(); ++k) {
          captures.emplace_back(node->getptr(), k);
        }
        break;
      }
    }
  }

  // B: one pass from the outputs to the inputs, capturing the gradients into the weight nodes.
  edge_list wanted;
  for (const auto& leaf : inputs) {
    const auto accumulator = leaf.requires_grad() ? impl::try_get_grad_accumulator(leaf) : nullptr;
    wanted.push_back(accumulator ? Edge(accumulator, 0) : Edge());
  }
  std::vector<size_t> valid;  // indices into `wanted` the engine is asked for
  edge_list asked;
  for (size_t i = 0; i < wanted.size(); ++i) {
    if (wanted[i].is_valid()) {
      valid.push_back(i);
      asked.push_back(wanted[i]);
    }
  }
  asked.insert(asked.end(), captures.begin(), captures.end());
  const auto results =
      torch::autograd::Engine::get_default_engine().execute(roots,
                                                            output_grads,
                                                            /*keep_graph=*/true,
                                                            /*create_graph=*/false,
                                                            /*accumulate_grad=*/false,
                                                            asked);
  std::vector<at::Tensor> input_grads(inputs.size());
  for (size_t j = 0; j < valid.size(); ++j) {
    input_grads[valid[j]] = results[j];
  }

  // W starts at every weight node, with the gradient it received, and at every output that
  // leads to parameters only. Each weight node's edges back towards the inputs are cut (B is
  // done with them, and the graph is freed after W), so that W, one engine call, runs only the
  // parameter side: no activation gradient is computed again, and no weight node is reached a
  // second time through the input path of another.
  work = WeightWork{};
  size_t next = valid.size();
  for (Node* node : weight_nodes) {
    for (uint32_t k = 0; k < node->num_inputs(); ++k, ++next) {
      if (results[next].defined()) {
        work.roots.emplace_back(node->getptr(), k);
        work.grads.push_back(results[next]);
      }
    }
    for (uint32_t i = 0; i < node->num_outputs(); ++i) {
      const Node* child = node->next_edge(i).function.get();
      if (child != nullptr && graph.reach.at(child).input) {
        // Not set_next_edge: that recomputes the node's topological number, which autograd
        // forbids once the node has a parent. The old number stays a valid upper bound.
        node->next_edges()[i] = Edge();
      }
    }
  }
  for (size_t i = 0; i < roots.size(); ++i) {
    const Node* node = roots[i].function.get();
    if (node != nullptr && graph.weight_only(node)) {
      work.roots.push_back(roots[i]);
      work.grads.push_back(output_grads[i]);
    }
  }
  for (const auto& p : parameters) {  // in the stage's order, the same on every rank
    const auto accumulator = p.requires_grad() ? impl::try_get_grad_accumulator(p) : nullptr;
    if (accumulator && graph.reach.count(accumulator.get())) {
      work.parameters.emplace_back(accumulator, 0);
    }
  }
  return input_grads;
}

void backward_weight(WeightWork& work) {
  if (!work.roots.empty() && !work.parameters.empty()) {
    torch::autograd::Engine::get_default_engine().execute(work.roots,
                                                          work.grads,
                                                          /*keep_graph=*/false,
                                                          /*create_graph=*/false,
                                                          /*accumulate_grad=*/true,
                                                          work.parameters);
  }
  work = WeightWork{};
}

}  // namespace torch_mp
