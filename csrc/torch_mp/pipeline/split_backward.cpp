#include "torch_mp/pipeline/split_backward.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>
#include <unordered_set>

namespace torch_mp::pipeline {
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

  // The parameter accumulators below `node`, in a deterministic order.
  void parameters_below(Node* node,
                        const std::unordered_set<const Node*>& parameters,
                        std::unordered_set<const Node*>& seen,
                        std::vector<Node*>& found) const {
    std::vector<Node*> stack{node};
    while (!stack.empty()) {
      Node* current = stack.back();
      stack.pop_back();
      if (!seen.insert(current).second) {
        continue;
      }
      if (parameters.count(current)) {
        found.push_back(current);
      }
      for (const auto& edge : current->next_edges()) {
        Node* child = edge.function.get();
        if (child != nullptr && reach.at(child).parameter) {
          stack.push_back(child);
        }
      }
    }
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

  // W's parts: each weight node with the gradients it received and the parameters below its
  // weight-only children; each output that leads to parameters only.
  work = WeightWork{};
  std::unordered_map<const Node*, int> uses;
  auto add_part = [&](edge_list part_roots, std::vector<at::Tensor> grads, Node* node) {
    std::unordered_set<const Node*> seen;
    std::vector<Node*> found;
    for (const auto& edge : node->next_edges()) {
      if (edge.function && graph.weight_only(edge.function.get())) {
        graph.parameters_below(edge.function.get(), parameter_nodes, seen, found);
      }
    }
    WeightWork::Part part{std::move(part_roots), std::move(grads), {}};
    for (Node* p : found) {
      ++uses[p];
      part.parameters.push_back(parameter_edges.at(p));
    }
    work.parts.push_back(std::move(part));
  };
  size_t next = valid.size();
  for (Node* node : weight_nodes) {
    edge_list part_roots;
    std::vector<at::Tensor> grads;
    for (uint32_t k = 0; k < node->num_inputs(); ++k, ++next) {
      if (results[next].defined()) {
        part_roots.emplace_back(node->getptr(), k);
        grads.push_back(results[next]);
      }
    }
    if (!part_roots.empty()) {
      add_part(std::move(part_roots), std::move(grads), node);
    }
  }
  for (size_t i = 0; i < roots.size(); ++i) {
    Node* node = roots[i].function.get();
    if (node != nullptr && graph.weight_only(node)) {
      // The output itself leads to parameters only: W starts at the output.
      std::unordered_set<const Node*> seen;
      std::vector<Node*> found;
      graph.parameters_below(node, parameter_nodes, seen, found);
      WeightWork::Part part{{roots[i]}, {output_grads[i]}, {}};
      for (Node* p : found) {
        ++uses[p];
        part.parameters.push_back(parameter_edges.at(p));
      }
      work.parts.push_back(std::move(part));
    }
  }
  for (const auto& [node, count] : uses) {
    if (count > 1) {  // a parameter shared by two parts: one backward from the outputs instead
      work.parts.clear();
      work.whole = true;
      work.outputs = outputs;
      work.output_grads = output_grads;
      break;
    }
  }
  return input_grads;
}

void backward_weight(WeightWork& work, const std::vector<at::Tensor>& parameters) {
  if (work.whole) {
    std::vector<at::Tensor> wanted;
    for (const auto& p : parameters) {
      if (p.requires_grad()) {
        wanted.push_back(p);
      }
    }
    if (!wanted.empty()) {
      torch::autograd::backward(
          work.outputs, work.output_grads, /*retain_graph=*/false, /*create_graph=*/false, wanted);
    }
  } else {
    for (auto& part : work.parts) {
      if (!part.parameters.empty()) {
        torch::autograd::Engine::get_default_engine().execute(part.roots,
                                                              part.grads,
                                                              /*keep_graph=*/false,
                                                              /*create_graph=*/false,
                                                              /*accumulate_grad=*/true,
                                                              part.parameters);
      }
    }
  }
  work = WeightWork{};
}

}  // namespace torch_mp::pipeline
