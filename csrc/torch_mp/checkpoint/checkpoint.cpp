#include "torch_mp/checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <filesystem>
#include <unordered_set>

#include "torch_mp/tensor_parallel/blocks.h"

namespace torch_mp::checkpoint {
namespace {

namespace tp = torch_mp::tensor_parallel;

constexpr const char* kModel = "model/";
constexpr const char* kExtra = "extra/";

/// `name` with the longest matching prefix of `pairs` replaced; nullopt when it is dropped.
template <typename Pairs>
std::optional<std::string> renamed(const std::string& name, const Pairs& pairs) {
  const typename Pairs::value_type* best = nullptr;
  for (const auto& pair : pairs) {
    if (name.rfind(pair.first, 0) == 0 && (!best || pair.first.size() > best->first.size())) {
      best = &pair;
    }
  }
  if (!best) {
    return name;
  }
  const std::optional<std::string> replacement = best->second;
  if (!replacement) {
    return std::nullopt;
  }
  return *replacement + name.substr(best->first.size());
}

const tp::DenseNames* dense_names_of(const torch::nn::Module& module) {
  if (dynamic_cast<const tp::ParallelSelfAttentionImpl*>(&module)) {
    return &tp::ParallelSelfAttentionImpl::dense_names();
  }
  if (dynamic_cast<const tp::ParallelTransformerLayerImpl*>(&module)) {
    return &tp::ParallelTransformerLayerImpl::dense_names();
  }
  return nullptr;
}

void walk(const torch::nn::Module& module,
          const std::string& prefix,
          std::vector<std::pair<std::string, DenseTensor>>& out) {
  // A module with dense names renames everything below it; any other keeps its names.
  const auto* names = dense_names_of(module);
  const bool below = names != nullptr;
  for (const auto& item : module.named_parameters(below)) {
    const auto local = names ? *renamed(item.key(), *names) : item.key();
    out.push_back({prefix + local, DenseTensor{"", item.value(), true}});
  }
  for (const auto& item : module.named_buffers(below)) {
    const auto local = names ? *renamed(item.key(), *names) : item.key();
    out.push_back({prefix + local, DenseTensor{"", item.value(), false}});
  }
  if (below) {
    return;
  }
  for (const auto& child : module.named_children()) {
    walk(*child.value(), prefix + child.key() + ".", out);
  }
}

/// The state tensors of `parameter` in `optimizer` by the Python optimizers' names, and its
/// step count; empty when it has none yet.
struct ParamState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::optional<int64_t> step;
};

template <typename State>
ParamState adam_state(const State& state) {
  ParamState out{{{"exp_avg", state.exp_avg()}, {"exp_avg_sq", state.exp_avg_sq()}}, state.step()};
  if (state.max_exp_avg_sq().defined()) {
    out.tensors.emplace_back("max_exp_avg_sq", state.max_exp_avg_sq());
  }
  return out;
}

ParamState state_of(torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
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

/// The kind of state `optimizer` keeps, by the names of its tensors: nullopt if unsupported.
std::optional<std::vector<std::string>> state_names(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) ||
      dynamic_cast<const torch::optim::Adam*>(&optimizer)) {
    return std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  }
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    return std::vector<std::string>{"momentum_buffer"};
  }
  return std::nullopt;
}

/// Raises unless the saved state `tensors` of parameter `name` fit `optimizer`'s kind.
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

/// Replaces `parameter`'s state in `optimizer` with `tensors` (checked by check_state_fits)
/// and step `step`.
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

std::vector<DenseTensor> all_dense_tensors(const std::vector<Stage>& stages) {
  std::vector<DenseTensor> out;
  for (const auto& stage : stages) {
    TORCH_CHECK(stage.module, "torch_mp::checkpoint: a stage without a module");
    auto mine = dense_tensors(*stage.module, stage.rename);
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

/// The shards of the model's tensors.
std::vector<Shard> model_shards(const std::vector<DenseTensor>& tensors, const Mesh& mesh) {
  std::vector<Shard> shards;
  for (const auto& t : tensors) {
    shards.push_back(shard_of(kModel + t.name, t.tensor, t.tensor, mesh.tp_group));
  }
  return shards;
}

/// A step count as a checkpoint holds it: a float32 scalar, as Python's Adam keeps it.
Shard step_shard(const std::string& name, at::Tensor value, const Mesh& mesh) {
  Shard shard{name, std::move(value)};
  shard.rank = mesh.tp_rank();
  shard.ranks = mesh.tp_size();
  return shard;
}

}  // namespace

std::vector<DenseTensor> dense_tensors(const torch::nn::Module& module, const Rename& rename) {
  std::vector<std::pair<std::string, DenseTensor>> found;
  walk(module, "", found);
  std::vector<DenseTensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& [name, tensor] : found) {
    const auto dense = renamed(name, rename);
    if (!dense || !seen.insert(tensor.tensor.unsafeGetTensorImpl()).second) {
      continue;
    }
    tensor.name = *dense;
    out.push_back(std::move(tensor));
  }
  return out;
}

void save(const std::string& path,
          const std::vector<Stage>& stages,
          torch::optim::Optimizer* optimizer,
          const std::map<std::string, std::string>& extra,
          std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  std::vector<Shard> shards;
  std::vector<std::string> problems;
  collect_problems(problems, [&] {
    const auto tensors = all_dense_tensors(stages);
    shards = model_shards(tensors, *mesh);
    if (!optimizer) {
      return;
    }
    std::unordered_set<const c10::TensorImpl*> named;
    for (const auto& t : tensors) {
      named.insert(t.tensor.unsafeGetTensorImpl());
    }
    int64_t outside = 0;
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        outside += named.count(p.unsafeGetTensorImpl()) ? 0 : 1;
      }
    }
    TORCH_CHECK(outside == 0,
                "the optimizer holds ",
                outside,
                " parameters that the stages do not name; their state would be lost");
    for (const auto& t : tensors) {
      if (!t.is_parameter) {
        continue;
      }
      const auto state = state_of(*optimizer, t.tensor);
      const std::string prefix = "optim/" + t.name + "/";
      for (const auto& [name, value] : state.tensors) {
        shards.push_back(shard_of(prefix + name, value, t.tensor, mesh->tp_group));
      }
      if (state.step) {
        shards.push_back(step_shard(prefix + "step",
                                    at::scalar_tensor(static_cast<double>(*state.step), at::kFloat),
                                    *mesh));
      }
    }
  });
  raise_anywhere(problems, "torch_mp::checkpoint::save of " + path + " failed", mesh->world);
  std::map<std::string, std::string> metadata{
      {"mesh",
       "tp=" + std::to_string(mesh->tp_size()) + " pp=" + std::to_string(mesh->pp_size()) +
           " dp=" + std::to_string(mesh->dp_size())},
      {"saved_by", "torch_mp C++"}};
  for (const auto& [key, value] : extra) {
    metadata[kExtra + key] = value;
  }
  std::vector<std::string> files;
  for (int64_t pp = 0; pp < mesh->pp_size(); ++pp) {
    for (int64_t t = 0; t < mesh->tp_size(); ++t) {
      files.push_back(shard_file(pp, t));
    }
  }
  const auto file = mesh->dp_rank() == 0
                        ? std::optional<std::string>(shard_file(mesh->pp_rank(), mesh->tp_rank()))
                        : std::nullopt;
  checkpoint::save(path, shards, file, files, metadata, {}, mesh->world);
}

std::map<std::string, std::string> load(const std::string& path,
                                        const std::vector<Stage>& stages,
                                        torch::optim::Optimizer* optimizer,
                                        std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  const Reader reader(path, mesh->world);
  // Optimizer state is read into new tensors, and replaces what the optimizer holds once
  // everything has been read; the model is written in place (Reader::load checks on every
  // rank that everything is there before it writes anything).
  struct Pending {
    at::Tensor parameter;
    std::map<std::string, at::Tensor> tensors = {};
    at::Tensor step = {};
  };
  std::vector<Pending> pending;
  std::vector<Shard> shards;
  std::vector<std::string> problems;
  collect_problems(problems, [&] {
    const auto tensors = all_dense_tensors(stages);
    shards = model_shards(tensors, *mesh);
    if (!optimizer) {
      return;
    }
    for (const auto& t : tensors) {
      if (!t.is_parameter) {
        continue;
      }
      const std::string prefix = "optim/" + t.name + "/";
      Pending p{t.tensor};
      for (auto it = reader.tensors().lower_bound(prefix);
           it != reader.tensors().end() && it->first.rfind(prefix, 0) == 0;
           ++it) {
        const auto state = it->first.substr(prefix.size());
        if (state == "step") {
          p.step = at::zeros({}, at::kFloat);
          shards.push_back(step_shard(it->first, p.step, *mesh));
        } else {
          p.tensors[state] = at::empty_like(t.tensor);
          shards.push_back(shard_of(it->first, p.tensors[state], t.tensor, mesh->tp_group));
        }
      }
      if (!p.tensors.empty()) {
        check_state_fits(*optimizer, p.tensors, t.name);
        pending.push_back(std::move(p));
      }
    }
  });
  raise_anywhere(problems, "torch_mp::checkpoint: cannot load " + reader.path(), mesh->world);
  reader.load(shards, mesh->world);
  for (auto& p : pending) {
    const auto step = p.step.defined() ? std::optional<int64_t>(std::llround(p.step.item<double>()))
                                       : std::nullopt;
    set_state(*optimizer, p.parameter, p.tensors, step);
  }
  std::map<std::string, std::string> extra;
  for (const auto& [key, value] : reader.metadata()) {
    if (key.rfind(kExtra, 0) == 0) {
      extra[key.substr(std::string(kExtra).size())] = value;
    }
  }
  return extra;
}

void load_dense(const std::string& path,
                const std::vector<Stage>& stages,
                std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  const Reader reader(path, mesh->world, kModel);
  std::vector<Shard> shards;
  std::vector<std::string> problems;
  collect_problems(problems, [&] { shards = model_shards(all_dense_tensors(stages), *mesh); });
  raise_anywhere(problems, "torch_mp::checkpoint: cannot load " + path, mesh->world);
  reader.load(shards, mesh->world);
}

void export_dense(const std::string& path,
                  const std::vector<Stage>& stages,
                  std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  const std::string parts = path + ".parts";
  save(parts, stages, nullptr, {}, mesh);
  std::vector<std::string> problems;
  if (mesh->rank == 0) {
    collect_problems(problems, [&] {
      consolidate(parts, path, kModel);
      std::filesystem::remove_all(parts);
    });
  }
  raise_anywhere(
      problems, "torch_mp::checkpoint::export_dense to " + path + " failed", mesh->world);
}

}  // namespace torch_mp::checkpoint
