#pragma once
// Training checkpoints of LibTorch modules, the C++ twin of torch_mp.checkpoint.save / load:
// the same directories (torch_mp/checkpoint/shards.h), so a model trained from Python resumes in
// a LibTorch application and the other way round, at any (tp, pp, dp).
//
//   torch_mp::checkpoint::save("ckpt", {{stage, rename}}, &optimizer, {{"step", "100"}});
//   const auto extra = torch_mp::checkpoint::load("ckpt", {{stage, rename}}, &optimizer);
//   auto saving = torch_mp::checkpoint::async_save("ckpt", {{stage, rename}}, &optimizer);
//   ...  // training goes on
//   saving->wait();
//   torch_mp::checkpoint::verify("ckpt");  // every block against its checksum (verify.h)
//
// Tensors are named as in the dense model: a tensor-parallel module's parameters as its dense
// counterpart names them (ParallelTransformerLayer's "self_attn.qkv.weight" is
// "self_attn.in_proj_weight"), a stage's names mapped by its Rename. Optimizer state (Adam and
// AdamW moments and step, SGD momentum) is saved under "optim/<name>/<state>", in the names the
// Python optimizers use, and resharded with its parameter; a DistributedOptimizer's as a plain
// optimizer's (optimizer_state.h), so it loads at any data-parallel size, sharded or not.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_mp/checkpoint/shards.h"
#include "torch_mp/mesh.h"

namespace torch_mp::checkpoint {

/// How a module's names become the dense model's: (prefix, replacement) pairs, the longest
/// matching prefix replaced; a replacement of nullopt leaves the tensor out.
using Rename = std::vector<std::pair<std::string, std::optional<std::string>>>;

/// One module this rank holds (the whole model, or one of its pipeline stages) and the Rename of
/// its names.
struct Stage {
  std::shared_ptr<torch::nn::Module> module;
  Rename rename = {};
};

/// A tensor of a module under its dense name.
struct DenseTensor {
  std::string name;
  at::Tensor tensor;
  bool is_parameter = false;
};

/// `module`'s parameters and buffers under the dense model's names (tensor-parallel modules'
/// through their dense_names(), then `rename`); a tensor reached under several names once.
std::vector<DenseTensor> dense_tensors(const torch::nn::Module& module, const Rename& rename = {});

/// Saves `stages` (this rank's modules), `optimizer`'s state (Adam, AdamW, SGD, or a
/// DistributedOptimizer over one of them; may be null)
/// and `extra` to the checkpoint directory `path`. Collective over every rank of `mesh` (the
/// default mesh when null). Crash-safe as shards.h's save.
void save(const std::string& path,
          const std::vector<Stage>& stages,
          torch::optim::Optimizer* optimizer = nullptr,
          const std::map<std::string, std::string>& extra = {},
          std::shared_ptr<Mesh> mesh = nullptr);

/// The group background saves over `world` use: a Gloo group over the world of their own (the
/// save's collectives would interleave with training's on a shared one), made over `store` (the
/// world's) once per world, with the world's timeout. Collective over the world the first time.
GroupPtr background_group(const GroupPtr& world, const StorePtr& store);

/// save in the background (async_save.h): what it will write is copied before it returns
/// (to pinned CPU memory from a GPU), so training may change the parameters and the optimizer
/// state at once; a thread then writes the copy, crash-safe as save. A save still running is
/// waited for first. Collective. Errors surface, on every rank, at the handle's wait(). The
/// background save talks over a Gloo group of its own, made (once) over `mesh`'s store.
std::shared_ptr<AsyncSave> async_save(const std::string& path,
                                      const std::vector<Stage>& stages,
                                      torch::optim::Optimizer* optimizer = nullptr,
                                      const std::map<std::string, std::string>& extra = {},
                                      std::shared_ptr<Mesh> mesh = nullptr);

/// Loads a checkpoint saved by either front end, at any layout, into `stages` and `optimizer`'s
/// state (its hyperparameters stay as constructed). Collective. Returns the `extra` it was
/// saved with. Raises on every rank, naming what is missing or misshapen, before changing
/// anything, and naming the file and the tensor of a block that fails its checksum. Warns
/// when the checkpoint records no checksums (saved by an older torch_mp): it cannot be
/// verified.
std::map<std::string, std::string> load(const std::string& path,
                                        const std::vector<Stage>& stages,
                                        torch::optim::Optimizer* optimizer = nullptr,
                                        std::shared_ptr<Mesh> mesh = nullptr);

/// Loads a dense safetensors file (keys as in the dense model's state dict: Python's
/// torch_mp.checkpoint.export_dense, or a dense model's saved state dict) into `stages`.
/// Collective.
void load_dense(const std::string& path,
                const std::vector<Stage>& stages,
                std::shared_ptr<Mesh> mesh = nullptr);

/// Writes the model as one dense safetensors file at `path` (what load_dense and Python's
/// torch_mp.checkpoint.load_dense read): every rank saves its parts beside it, rank 0 joins
/// them. Collective.
void export_dense(const std::string& path,
                  const std::vector<Stage>& stages,
                  std::shared_ptr<Mesh> mesh = nullptr);

}  // namespace torch_mp::checkpoint
