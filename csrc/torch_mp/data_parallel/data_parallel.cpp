#include "torch_mp/data_parallel/data_parallel.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <functional>
#include <unordered_map>

#include "torch_mp/data_parallel/owners.h"
#include "torch_mp/mesh.h"

namespace torch_mp::data_parallel {
namespace {

bool is_container(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::ModuleListImpl*>(&m) ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&m);
}

// Whether module type `name` (Module::name(): "ns::BlockImpl") is named by `type` ("Block",
// "BlockImpl", "ns::Block").
bool names_type(const std::string& name, const std::string& type) {
  for (const std::string& full : {type, type + "Impl"}) {
    if (name == full ||
        (name.size() > full.size() + 2 &&
         name.compare(name.size() - full.size() - 2, std::string::npos, "::" + full) == 0)) {
      return true;
    }
  }
  return false;
}

// Each parameter's unit (aligned with module.parameters()): the innermost unit whose modules
// hold every use of it; unit 0 is `module` itself.
std::vector<size_t> units_of(torch::nn::Module& module, const std::vector<std::string>& types) {
  std::unordered_map<const torch::nn::Module*, bool> is_unit;
  if (types.empty()) {  // each child, containers' members instead of containers
    std::vector<std::shared_ptr<torch::nn::Module>> todo = module.children();
    while (!todo.empty()) {
      auto child = todo.back();
      todo.pop_back();
      if (is_container(*child)) {
        for (auto& c : child->children()) {
          todo.push_back(c);
        }
      } else {
        is_unit[child.get()] = true;
      }
    }
  }
  std::unordered_map<const torch::nn::Module*, size_t> index{{&module, 0}};
  std::unordered_map<const c10::TensorImpl*, std::vector<size_t>> chains;
  // Depth first, each path's chain of units from the root (a shared module under each path).
  std::function<void(torch::nn::Module&, const std::string&, std::vector<size_t>)> walk =
      [&](torch::nn::Module& m, const std::string& path, std::vector<size_t> chain) {
        if (&m != &module) {
          bool unit = types.empty() ? is_unit.count(&m) > 0 : false;
          for (const auto& type : types) {
            unit = unit || names_type(m.name(), type);
          }
          if (unit) {
            TORCH_CHECK(!is_container(m),
                        "DataParallel: units names ",
                        path,
                        ", a ",
                        m.name(),
                        ", which is never called (its members are): its parameters would never "
                        "be gathered; name the members' type instead");
            const auto found = index.emplace(&m, index.size()).first;
            chain.push_back(found->second);
          }
        }
        for (const auto& p : m.parameters(/*recurse=*/false)) {
          const auto known = chains.find(p.unsafeGetTensorImpl());
          if (known == chains.end()) {
            chains.emplace(p.unsafeGetTensorImpl(), chain);
            continue;
          }
          size_t k = 0;  // shared: the common part of both chains
          while (k < known->second.size() && k < chain.size() && known->second[k] == chain[k]) {
            ++k;
          }
          known->second.resize(k);
        }
        for (const auto& child : m.named_children()) {
          walk(*child.value(), path.empty() ? child.key() : path + "." + child.key(), chain);
        }
      };
  walk(module, "", {0});
  std::vector<size_t> units;
  for (const auto& p : module.parameters()) {
    units.push_back(chains.at(p.unsafeGetTensorImpl()).back());
  }
  return units;
}

}  // namespace

DataParallelImpl::DataParallelImpl(std::shared_ptr<torch::nn::Module> module_,
                                   DataParallelOptions options_)
    : module(std::move(module_)), options(std::move(options_)) {
  TORCH_CHECK(module, "DataParallel: no module");
  if (!options.group()) {
    options.group(get_mesh()->dp_cp_group);
  }
  if (const auto mesh = find_mesh(); mesh && !options.expert_group()) {
    options.expert_group(mesh->ep_group).expert_data_group(mesh->expert_dp_group);
  }
  register_module("module", module);
  const auto names = module->named_parameters().keys();
  TORCH_CHECK(options.units().empty() || options.shard_parameters(),
              "DataParallel: units are for shard_parameters(true)");
  if (options.shard_gradients() || options.grad_dtype() || options.shard_parameters()) {
    TORCH_CHECK(options.comm_hook() == CommHook::kNone,
                "DataParallel: shard_gradients (grad_dtype, shard_parameters) takes no "
                "comm_hook");
    for (const auto& p : module->parameters()) {
      TORCH_CHECK(!is_expert_parameter(p, options.expert_group()),
                  "DataParallel: shard_gradients (or grad_dtype) does not take a mixture of "
                  "experts' expert parameters yet (a parameter of shape ",
                  p.sizes(),
                  " is sharded over the expert group)");
    }
    sharded_ = ShardedState::create(
        module->parameters(),
        module->buffers(),
        options.group(),
        ShardedStateOptions()
            .bucket_cap_mb(options.bucket_cap_mb())
            .grad_dtype(options.grad_dtype())
            .broadcast_buffers(options.broadcast_buffers())
            .names(names)
            .shard_parameters(options.shard_parameters())
            .units(options.shard_parameters() ? units_of(*module, options.units())
                                              : std::vector<size_t>{}));
    return;
  }
  sync_ =
      std::make_unique<GradientSync>(module->parameters(),
                                     module->buffers(),
                                     options.group(),
                                     GradientSyncOptions()
                                         .bucket_cap_mb(options.bucket_cap_mb())
                                         .gradient_as_bucket_view(options.gradient_as_bucket_view())
                                         .comm_hook(options.comm_hook())
                                         .broadcast_buffers(options.broadcast_buffers())
                                         .expert_group(options.expert_group())
                                         .expert_data_group(options.expert_data_group())
                                         .names(names));
}

void DataParallelImpl::prepare_for_forward() {
  wait_for_gathers(module->parameters());  // (LibTorch has no forward pre-hooks)
  sync_ ? sync_->prepare_for_forward() : sharded_->prepare_for_forward();
  if (sharded_ && sharded_->shards_parameters()) {
    for (size_t u = 0; u < sharded_->num_units(); ++u) {  // each prefetches the next
      sharded_->before_forward(u);
    }
  }
}

void DataParallelImpl::finish_forward(const std::vector<at::Tensor>& outputs) {
  if (!sharded_ || !sharded_->shards_parameters()) {
    return;
  }
  const size_t units = sharded_->num_units();
  for (size_t u = 0; u < units; ++u) {
    sharded_->after_forward(u);
  }
  if (!at::GradMode::is_enabled()) {
    return;
  }
  std::weak_ptr<ShardedState> weak = sharded_;
  for (const auto& output : outputs) {
    if (output.defined() && output.requires_grad()) {
      output.register_hook([weak, units](const at::Tensor&) {
        if (auto engine = weak.lock()) {
          for (size_t u = units; u-- > 0;) {  // in backward order, each prefetching the next
            engine->before_backward(u);
          }
        }
      });
    }
  }
}

void DataParallelImpl::zero_grad(bool set_to_none) {
  torch::nn::Module::zero_grad(set_to_none);
  if (sharded_) {
    sharded_->zero_grad();
  }
}

void DataParallelImpl::prepare_for_backward() {
  sync_ ? sync_->prepare_for_backward() : sharded_->prepare_for_backward();
}

}  // namespace torch_mp::data_parallel
