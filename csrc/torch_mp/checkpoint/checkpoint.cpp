#include "torch_mp/checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <unordered_set>

#include "torch_mp/checkpoint/atomic_files.h"
#include "torch_mp/checkpoint/optimizer_state.h"
#include "torch_mp/data_parallel/sharded_state.h"
#include "torch_mp/layout.h"
#include "torch_mp/optim/parameter_shards.h"
#include "torch_mp/tensor_parallel/attention.h"
#include "torch_mp/tensor_parallel/conv_block.h"
#include "torch_mp/tensor_parallel/layer_norm.h"
#include "torch_mp/tensor_parallel/mlp.h"
#include "torch_mp/tensor_parallel/transformer_layer.h"

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

std::vector<DenseTensor> all_dense_tensors(const std::vector<Stage>& stages) {
  std::vector<DenseTensor> out;
  for (const auto& stage : stages) {
    TORCH_CHECK(stage.module, "torch_mp::checkpoint: a stage without a module");
    auto mine = dense_tensors(*stage.module, stage.rename);
    out.insert(out.end(), mine.begin(), mine.end());
  }
  // (an overlapped all-gather of a DistributedOptimizer's step would write into them later)
  std::vector<at::Tensor> tensors;
  for (const auto& t : out) {
    tensors.push_back(t.tensor);
  }
  optim::wait_for_gathers(tensors);
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

namespace {

// Where this rank sits, as its save plans its files.
SaveLayout save_layout(const Mesh& mesh) {
  return {mesh.pp_size(),
          mesh.tp_size(),
          mesh.ep_size(),
          mesh.cp_size(),
          mesh.pp_rank(),
          mesh.tp_rank(),
          mesh.dp_rank(),
          mesh.cp_rank()};
}

// What this rank's save of `stages` and `optimizer` writes (shard_writer.h's save's arguments).
SaveRequest save_request(const std::string& path,
                         const std::vector<Stage>& stages,
                         torch::optim::Optimizer* optimizer,
                         const std::map<std::string, std::string>& extra,
                         const std::shared_ptr<Mesh>& mesh) {
  std::vector<Shard> shards;
  std::vector<bool> over_experts;  // each shard's: a mixture of experts' tensor (expert group)
  std::vector<std::string> problems;
  collect_problems(problems, [&] {
    const auto tensors = all_dense_tensors(stages);
    shards = model_shards(tensors, *mesh);
    for (const auto& t : tensors) {
      over_experts.push_back(over_expert_group(t.tensor, mesh->ep_group));
    }
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
    const auto states = states_by_parameter(*optimizer);
    for (const auto& t : tensors) {
      const auto found = states.find(t.tensor.unsafeGetTensorImpl());
      if (!t.is_parameter || found == states.end()) {
        continue;
      }
      const auto& state = found->second;
      const std::string prefix = "optim/" + t.name + "/";
      for (const auto& [name, value] : state.tensors) {
        shards.push_back(shard_of(prefix + name, value, t.tensor, mesh->tp_group));
        over_experts.push_back(over_expert_group(t.tensor, mesh->ep_group));
      }
      if (state.step) {
        shards.push_back(step_shard(prefix + "step",
                                    at::scalar_tensor(static_cast<double>(*state.step), at::kFloat),
                                    *mesh));
        over_experts.push_back(false);
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
  auto plan = plan_save(save_layout(*mesh), over_experts);
  std::vector<Shard> kept;
  for (const size_t i : plan.kept) {
    kept.push_back(std::move(shards[i]));
  }
  return {.shards = std::move(kept),
          .file = std::move(plan.file),
          .files = std::move(plan.files),
          .metadata = std::move(metadata),
          .root_files = {}};
}

void warn_if_unchecked(const Reader& reader) {
  if (const auto unchecked = reader.unchecked_files(); !unchecked.empty()) {
    TORCH_WARN("torch_mp::checkpoint: ",
               reader.path(),
               " records no checksums, or not all of them (saved by an older torch_mp, or by "
               "another program), so what is read of it cannot be verified: ",
               summary_of(unchecked));
  }
}

// Every stage's parameters, for a ZeRO-3 DataParallel's units to be gathered around a save or
// a load (data_parallel::WholeParameters).
std::vector<at::Tensor> parameters_of(const std::vector<Stage>& stages) {
  std::vector<at::Tensor> out;
  for (const auto& stage : stages) {
    const auto mine = stage.module->parameters();
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

}  // namespace

GroupPtr background_group(const GroupPtr& world, const StorePtr& store) {
  static std::mutex mutex;
  static std::map<const c10d::ProcessGroup*, std::pair<GroupPtr, GroupPtr>> groups;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto known = groups.find(world.get());
    if (known != groups.end()) {
      return known->second.second;
    }
  }
  // Made without the lock: ranks that are threads of one process (tests) make theirs at once.
  TORCH_CHECK(store,
              "torch_mp::checkpoint::async_save: no store to make the background save's group "
              "over (make the mesh with torch_mp::init or make_mesh)");
  // The world's timeout: its Gloo side's, else its NCCL side's, else c10d's default.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  for (const auto backend :
       {c10d::ProcessGroup::BackendType::GLOO, c10d::ProcessGroup::BackendType::NCCL}) {
    try {
      timeout = world->getBackend(backend)->getBackendOptions()->timeout;
      break;
    } catch (const std::exception&) {
      // (no such side)
    }
  }
  // Store keys of its own, agreed over the world (rank 0's clock).
  const std::string name = "torch_mp/checkpoint/" + save_tag(world);
  auto group = new_process_group(c10::make_intrusive<c10d::PrefixStore>(name, store),
                                 world->getRank(),
                                 world->getSize(),
                                 Backend::kGloo,
                                 timeout,
                                 "torch_mp/checkpoint");
  std::lock_guard<std::mutex> lock(mutex);
  groups[world.get()] = {world, group};
  return group;
}

void save(const std::string& path,
          const std::vector<Stage>& stages,
          torch::optim::Optimizer* optimizer,
          const std::map<std::string, std::string>& extra,
          std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  const data_parallel::WholeParameters whole(parameters_of(stages));
  const auto request = save_request(path, stages, optimizer, extra, mesh);
  checkpoint::save(path, request, mesh->world);
}

std::shared_ptr<AsyncSave> async_save(const std::string& path,
                                      const std::vector<Stage>& stages,
                                      torch::optim::Optimizer* optimizer,
                                      const std::map<std::string, std::string>& extra,
                                      std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  const data_parallel::WholeParameters whole(parameters_of(stages));  // (copied before return)
  const auto request = save_request(path, stages, optimizer, extra, mesh);
  return checkpoint::async_save(path, request, background_group(mesh->world, mesh->store));
}

std::map<std::string, std::string> load(const std::string& path,
                                        const std::vector<Stage>& stages,
                                        torch::optim::Optimizer* optimizer,
                                        std::shared_ptr<Mesh> mesh) {
  mesh = mesh ? mesh : get_mesh();
  const Reader reader(path, mesh->world);
  warn_if_unchecked(reader);
  data_parallel::WholeParameters whole(parameters_of(stages), /*write_back=*/true);
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
  whole.release();  // (each rank keeps its range of what was read)
  std::vector<LoadedState> loaded;
  for (auto& p : pending) {
    const auto step = p.step.defined() ? std::optional<int64_t>(std::llround(p.step.item<double>()))
                                       : std::nullopt;
    loaded.push_back({p.parameter, std::move(p.tensors), step});
  }
  if (optimizer) {
    set_states(*optimizer, loaded);
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
  warn_if_unchecked(reader);
  const data_parallel::WholeParameters whole(parameters_of(stages), /*write_back=*/true);
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
