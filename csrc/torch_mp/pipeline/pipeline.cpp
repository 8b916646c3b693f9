#include "torch_mp/pipeline/pipeline.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "torch_mp/collectives.h"
#include "torch_mp/comm.h"
#include "torch_mp/data_parallel/gradient_sync.h"
#include "torch_mp/data_parallel/sharded_state.h"
#include "torch_mp/layout.h"
#include "torch_mp/mesh.h"

namespace torch_mp::pipeline {
namespace {

GroupPtr group_or_default(const GroupPtr& group) { return group ? group : get_mesh()->pp_group; }

// A tied parameter whose gradient a DataParallel(shard_gradients=True) reduce-scattered: no rank
// holds it whole. Each data rank writes its pieces into a zero gradient, a sum over the data
// group puts the averaged gradient together, a sum over the embedding group adds the tied copy's,
// and each rank keeps its pieces of the total (piece_gradient is a 1-D view into the reduced
// gradients). Every rank of the data group takes part in both sums, pieces or none.
void tie_sharded_gradient(const at::Tensor& p,
                          const data_parallel::ShardedState& engine,
                          const GroupPtr& embedding_group) {
  const auto& parameters = engine.parameters();
  const auto found = std::find_if(parameters.begin(), parameters.end(), [&](const at::Tensor& q) {
    return q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
  });
  TORCH_INTERNAL_ASSERT(found != parameters.end());
  const auto index = static_cast<size_t>(found - parameters.begin());
  const auto& pieces = engine.layout().pieces;
  auto whole = at::zeros({p.numel()}, p.options().dtype(engine.gradient_dtype(p)));
  for (size_t s = 0; s < pieces.size(); ++s) {
    if (pieces[s].parameter == index) {
      whole.narrow(0, pieces[s].offset, pieces[s].numel).copy_(engine.piece_gradient(s));
    }
  }
  whole = comm::all_reduce(comm::all_reduce(whole, engine.group()), embedding_group);
  for (size_t s = 0; s < pieces.size(); ++s) {
    if (pieces[s].parameter == index) {
      engine.piece_gradient(s).copy_(whole.narrow(0, pieces[s].offset, pieces[s].numel));
    }
  }
}

}  // namespace

Stage stage_of(torch::nn::Sequential module) {
  std::vector<at::Tensor> parameters = module->parameters();
  return Stage{[module](const std::vector<at::Tensor>& inputs) mutable -> std::vector<at::Tensor> {
                 TORCH_CHECK(inputs.size() == 1,
                             "Pipeline: a torch::nn::Sequential stage takes one tensor, got ",
                             inputs.size());
                 return {module->forward(inputs[0])};
               },
               std::move(parameters),
               {}};
}

Stage stage_of(data_parallel::DataParallel module) {
  std::vector<at::Tensor> parameters = module->parameters();
  return Stage{[module](const std::vector<at::Tensor>& inputs) mutable -> std::vector<at::Tensor> {
                 TORCH_CHECK(inputs.size() == 1,
                             "Pipeline: a DataParallel stage takes one tensor, got ",
                             inputs.size());
                 auto no_sync = module->no_sync();
                 return {module->forward(inputs[0])};
               },
               std::move(parameters),
               [module]() mutable { module->prepare_for_backward(); }};
}

Stage stage_of(data_parallel::DataParallel module,
               std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward) {
  std::vector<at::Tensor> parameters = module->parameters();
  return Stage{[module, forward = std::move(forward)](
                   const std::vector<at::Tensor>& inputs) mutable -> std::vector<at::Tensor> {
                 module->prepare_for_forward();
                 return forward(inputs);
               },
               std::move(parameters),
               [module]() mutable { module->prepare_for_backward(); }};
}

Pipeline::Pipeline(std::vector<Stage> stages, LossFn loss, PipelineOptions options) {
  const GroupPtr group = group_or_default(options.group());
  const auto per_rank = static_cast<int64_t>(stages.size());
  Schedule schedule = make_schedule(
      options.schedule(), group->getSize() * per_rank, options.num_microbatches(), per_rank);
  executor_ =
      std::make_unique<Executor>(std::move(schedule), std::move(stages), std::move(loss), group);
}

Pipeline::Pipeline(std::vector<Stage> stages, LossFn loss, Schedule schedule, GroupPtr group)
    : executor_(std::make_unique<Executor>(
          std::move(schedule), std::move(stages), std::move(loss), group_or_default(group))) {}

std::vector<std::vector<at::Tensor>> Pipeline::split(const std::vector<at::Tensor>& batch) const {
  if (batch.empty()) {
    return {};
  }
  return split_microbatches(batch, schedule().num_microbatches);
}

void Pipeline::tie_parameters(std::vector<at::Tensor> parameters, GroupPtr embedding_group) {
  const Schedule& s = schedule();
  const int64_t rank = executor_->rank();
  const bool first = s.rank_of_stage(0) == rank;
  const bool last = s.rank_of_stage(s.num_stages - 1) == rank;
  if (first && last) {
    TORCH_CHECK(parameters.empty(),
                "Pipeline: tied parameters: rank ",
                rank,
                " holds both the first and the last stage; share one parameter between them "
                "instead");
    return;
  }
  if (!first && !last) {
    TORCH_CHECK(parameters.empty(),
                "Pipeline: tied parameters: rank ",
                rank,
                " holds neither the first nor the last stage, so it has none to tie");
    return;
  }
  if (!embedding_group) {
    embedding_group = get_mesh()->embedding_group;
  }
  TORCH_CHECK(embedding_group && embedding_group->getSize() == 2,
              "Pipeline: tied parameters need an embedding group of the first and last stages' "
              "ranks (torch_mp.init makes one)");
  comm::check_same_tensors_across_ranks(
      parameters, embedding_group, "Pipeline: the tied parameters of the first and last stage");
  {
    at::NoGradGuard no_grad;
    data_parallel::broadcast_from_first_rank(parameters, embedding_group);
  }
  if (last) {
    for (const auto& p : parameters) {
      mark_tied_copy(p, {});
    }
  }
  tied_ = std::move(parameters);
  embedding_group_ = std::move(embedding_group);
}

void Pipeline::reset(const StorePtr& store, const std::string& key) {
  StorePtr base = store;
  std::string name = key;
  if (!base) {
    const auto mesh = get_mesh();
    TORCH_CHECK(mesh && mesh->store,
                "Pipeline.reset: no store given and no default mesh with one; pass the store the "
                "pipeline group's ranks share and a key for the group");
    base = mesh->store;
    const auto coord = mesh->shape.coord(mesh->rank);
    name = "dp" + std::to_string(coord.dp) + "_tp" + std::to_string(coord.tp);
  }
  TORCH_CHECK(!name.empty(), "Pipeline.reset: the key must not be empty");
  const GroupPtr& old = executor_->group();
  const bool nccl = is_nccl(old);
  std::chrono::milliseconds timeout(30000);
  try {
    timeout = old->getBackend(nccl ? c10d::ProcessGroup::BackendType::NCCL
                                   : c10d::ProcessGroup::BackendType::GLOO)
                  ->getBackendOptions()
                  ->timeout;
  } catch (const std::exception&) {
    // A group without Gloo options keeps the default.
  }
  // Keys unique to this pipeline (its id is agreed over the group) and to this reset.
  const std::string prefix = "torch_mp/pipeline_reset/" + name + "/" +
                             std::to_string(executor_->id()) + "/" + std::to_string(++resets_);
  auto group = new_process_group(c10::make_intrusive<c10d::PrefixStore>(prefix, base),
                                 static_cast<int>(old->getRank()),
                                 static_cast<int>(old->getSize()),
                                 nccl ? Backend::kNccl : Backend::kGloo,
                                 timeout,
                                 "pipeline_reset");
  executor_->reset(std::move(group));
}

std::optional<at::Tensor> Pipeline::step(const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& targets) {
  auto loss = executor_->step(split(inputs), split(targets));
  for (auto& p : tied_) {
    if (const auto engine = data_parallel::ShardedState::of(p)) {
      tie_sharded_gradient(p, *engine, embedding_group_);
      continue;
    }
    at::Tensor grad = p.grad();
    if (!grad.defined()) {
      grad = at::zeros_like(p);
      p.mutable_grad() = grad;
    }
    grad.copy_(comm::all_reduce(grad, embedding_group_));
  }
  return loss;
}

std::pair<std::vector<at::Tensor>, std::optional<at::Tensor>> Pipeline::eval_step(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) {
  return executor_->eval_step(split(inputs), split(targets));
}

std::optional<std::vector<TimedAction>> Pipeline::gathered_trace() const {
  // Each rank's actions as rows [rank, kind, stage, micro-batch, start, end], in one text.
  std::string mine(trace().size() * sizeof(double) * 6, '\0');
  char* row = mine.data();
  for (const auto& t : trace()) {
    const double values[] = {static_cast<double>(t.rank),
                             static_cast<double>(t.action.kind),
                             static_cast<double>(t.action.stage),
                             static_cast<double>(t.action.microbatch),
                             t.start,
                             t.end};
    std::memcpy(row, values, sizeof(values));
    row += sizeof(values);
  }
  const auto& group = executor_->group();
  const auto all = comm::all_gather_text(mine, group);
  if (group->getRank() != 0) {
    return std::nullopt;
  }
  std::vector<TimedAction> out;
  for (const auto& text : all) {
    std::vector<double> values(text.size() / sizeof(double));
    std::memcpy(values.data(), text.data(), values.size() * sizeof(double));
    for (size_t i = 0; i + 6 <= values.size(); i += 6) {
      const Action action{static_cast<ActionKind>(static_cast<int>(values[i + 1])),
                          static_cast<int64_t>(values[i + 2]),
                          static_cast<int64_t>(values[i + 3])};
      out.push_back({static_cast<int64_t>(values[i]), action, values[i + 4], values[i + 5]});
    }
  }
  return out;
}

}  // namespace torch_mp::pipeline
