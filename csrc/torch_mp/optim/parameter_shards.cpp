#include "torch_mp/optim/parameter_shards.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"
#include "torch_mp/data_parallel/gradient_hooks.h"
#include "torch_mp/data_parallel/gradient_sync.h"
#include "torch_mp/data_parallel/owners.h"
#include "torch_mp/data_parallel/sharded_state.h"

namespace torch_mp::optim {

using data_parallel::flat_view;
using data_parallel::GradientSync;
using data_parallel::parameter_name;
using data_parallel::ShardBucket;
using data_parallel::ShardedState;

namespace {

// The sharded state that reduce-scatters the gradients of `parameters`: `handed`, or the one
// the owners' map holds for them (none: no DataParallel shards them); raises unless it holds
// exactly these parameters, in this order (its layout is then ours).
std::shared_ptr<ShardedState> sharded_state_of(const std::vector<at::Tensor>& parameters,
                                               const std::vector<std::string>& names,
                                               const GroupPtr& group,
                                               std::shared_ptr<ShardedState> handed) {
  std::shared_ptr<ShardedState> engine = std::move(handed);
  for (size_t i = 0; !engine && i < parameters.size(); ++i) {
    engine = ShardedState::of(parameters[i]);
  }
  if (!engine) {
    return nullptr;
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    TORCH_CHECK(ShardedState::of(parameters[i]) == engine,
                "DistributedOptimizer: ",
                parameter_name(names, parameters, i),
                " is not in the DataParallel(shard_gradients=True) that reduces the others' "
                "gradients; give the optimizer exactly that module's parameters "
                "(module.parameters()), with every other parameter in another optimizer");
  }
  const auto& held = engine->parameters();
  bool same = held.size() == parameters.size();
  for (size_t i = 0; same && i < held.size(); ++i) {
    same = held[i].is_same(parameters[i]);
  }
  TORCH_CHECK(same,
              "DistributedOptimizer: a DataParallel that shards gradients holds ",
              held.size(),
              " parameters (those that require grad); give the optimizer exactly those, in the "
              "module's order (module.parameters()), so that both cut them alike");
  TORCH_CHECK(engine->group().get() == group.get(),
              "DistributedOptimizer: its data-parallel group is not its DataParallel's");
  return engine;
}

// Raises, naming the first, unless a DataParallel (or PyTorch's DDP, whose Reducer hooks the
// gradient accumulators as ours do) averages every parameter's gradient over the group, and
// their last synced backwards gave each of them a gradient.
void check_gradients_averaged(const std::vector<at::Tensor>& parameters,
                              const std::vector<std::string>& names,
                              const GroupPtr& group) {
  if (group->getSize() == 1) {
    return;  // this rank's gradients are the average
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    TORCH_CHECK(GradientSync::of(parameters[i]) || data_parallel::has_gradient_hooks(parameters[i]),
                "DistributedOptimizer: ",
                parameter_name(names, parameters, i),
                " is not in a torch_mp.DataParallel (nor a DistributedDataParallel), so its "
                "gradient is this rank's own, not the average over the ",
                group->getSize(),
                " data-parallel ranks; wrap the module that holds it, or step it with another "
                "optimizer");
  }
  data_parallel::check_reductions_complete(parameters);
}

}  // namespace

ParameterShards::ParameterShards(std::vector<at::Tensor> parameters,
                                 GroupPtr group,
                                 ParameterShardsOptions options)
    : parameters_(std::move(parameters)),
      group_(std::move(group)),
      names_(options.names()),
      master_dtype_(options.master_dtype()),
      overlap_param_gather_(options.overlap_param_gather()) {
  TORCH_CHECK(group_, "DistributedOptimizer: no data-parallel group");
  // (A refusal every rank meets alike: the ranks of the group hold the same module.)
  TORCH_CHECK(names_.empty() || names_.size() == parameters_.size(),
              "DistributedOptimizer: ",
              names_.size(),
              " parameter names for ",
              parameters_.size(),
              " parameters");
  for (size_t i = 0; i < parameters_.size(); ++i) {
    TORCH_CHECK(
        !data_parallel::is_expert_parameter(parameters_[i], options.expert_group()),
        "DistributedOptimizer: ",
        parameter_name(names_, parameters_, i),
        " is one of a mixture of experts' expert parameters (sharded over the expert group): "
        "they are not sharded by the distributed optimizer yet; step them with a plain "
        "optimizer");
  }
  comm::check_same_tensors_across_ranks(
      parameters_, group_, "DistributedOptimizer: the parameters of the data-parallel ranks");
  gradients_ = sharded_state_of(parameters_, names_, group_, options.sharded_state());
  sharded_ = gradients_ && gradients_->shards_parameters();
  if (gradients_) {  // (its buckets are ours)
    layout_ = gradients_->layout();
  } else {
    layout_ = data_parallel::ShardLayout::of(parameters_,
                                             group_->getSize(),
                                             group_->getRank(),
                                             options.bucket_cap_mb(),
                                             "DistributedOptimizer");
  }
  if (group_->getSize() > 1 && !sharded_) {
    // From now on each bucket is one flat tensor and its parameters are views of their ranges
    // (their identity stays), so that the all-gather after a step writes into the parameters
    // themselves: no copy into a send buffer, none out of the received one.
    at::NoGradGuard no_grad;
    for (const ShardBucket& bucket : layout_.buckets) {
      at::Tensor flat = at::zeros({bucket.chunk * group_->getSize()},
                                  at::TensorOptions().dtype(bucket.dtype).device(bucket.device));
      for (size_t j = 0; j < bucket.parameters.size(); ++j) {
        const at::Tensor& p = parameters_[bucket.parameters[j]];
        at::Tensor range = flat.narrow(0, bucket.starts[j], p.numel());
        range.copy_(flat_view(p));
        p.set_data(range.view(p.sizes()));
      }
      flat_.push_back(std::move(flat));
    }
    gathering_.resize(layout_.buckets.size());
  }
  if (overlap_param_gather_ && group_->getSize() > 1 && !sharded_) {
    std::vector<size_t> bucket_of(parameters_.size());
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      for (const size_t i : layout_.buckets[b].parameters) {
        bucket_of[i] = b;
      }
    }
    data_parallel::change_owners(parameters_, [&](size_t i, data_parallel::Owners& owner) {
      owner.gathers = this;
      owner.bucket = bucket_of[i];
    });
  }
  if (!sharded_) {  // (ZeRO-3 parameters' data changes at every gather)
    for (const auto& p : parameters_) {
      data_of_.push_back(p.data_ptr());
    }
  }
  for (size_t s = 0; s < layout_.pieces.size(); ++s) {
    const ShardPiece& piece = layout_.pieces[s];
    const at::Tensor& p = parameters_[piece.parameter];
    at::Tensor view = piece_of_parameter(s);
    if (master_dtype_ && *master_dtype_ != p.scalar_type()) {
      masters_ = true;
      shards_.push_back(view.to(*master_dtype_, /*non_blocking=*/false, /*copy=*/true));
    } else {
      shards_.push_back(view);
    }
  }
}

std::vector<int64_t> ParameterShards::shape(size_t i) const {
  return sharded_ ? gradients_->parameter_shape(i) : parameters_.at(i).sizes().vec();
}

at::ScalarType ParameterShards::shard_dtype(const ShardBucket& bucket) const {
  return master_dtype_ ? *master_dtype_ : bucket.dtype;
}

ParameterShards::~ParameterShards() {
  data_parallel::change_owners(parameters_, [this](size_t, data_parallel::Owners& owner) {
    if (owner.gathers == this) {
      owner.gathers = nullptr;
    }
  });
  // All-gathers still running hold their buckets themselves: no wait here (a destructor may
  // run where waiting would deadlock, as under Python's lock, which Gloo's threads take to
  // free a finished work's tensors).
}

void ParameterShards::take_gradients() {
  wait_for_parameters();
  const auto& pieces = layout_.pieces;
  if (!gradients_) {  // a sharding DataParallel made after us would leave every .grad empty
    for (const auto& p : parameters_) {
      TORCH_CHECK(!ShardedState::of(p),
                  "DistributedOptimizer: a DataParallel(shard_gradients=True or "
                  "shard_parameters=True) made after this optimizer reduces its parameters' "
                  "gradients, so it would find none; build the optimizer after wrapping the "
                  "module");
    }
  }
  for (size_t i = 0; i < data_of_.size(); ++i) {
    TORCH_CHECK(parameters_[i].data_ptr() == data_of_[i],
                "DistributedOptimizer: the data of ",
                parameter_name(names_, parameters_, i),
                " was replaced after the optimizer was built (by module.to(...), or an "
                "assignment to .data), so its steps would no longer reach it; build the "
                "optimizer after the model is in its final dtype and device");
  }
  if (!gradients_) {
    check_gradients_averaged(parameters_, names_, group_);
  }
  follow_parameters();
  for (size_t s = 0; s < pieces.size(); ++s) {
    at::Tensor& target = shards_[s].mutable_grad();
    at::Tensor grad;
    if (gradients_) {
      grad = gradients_->piece_gradient(s);
    } else if (parameters_[pieces[s].parameter].grad().defined()) {
      grad = flat_view(parameters_[pieces[s].parameter].grad())
                 .narrow(0, pieces[s].offset, pieces[s].numel);
    }
    if (!grad.defined()) {
      target.reset();
    } else {
      target =
          grad.scalar_type() == shards_[s].scalar_type() ? grad : grad.to(shards_[s].scalar_type());
    }
  }
}

at::Tensor ParameterShards::piece_of_parameter(size_t s) const {
  const ShardPiece& piece = layout_.pieces[s];
  return sharded_ ? gradients_->parameter_piece(s)
                  : flat_view(parameters_[piece.parameter]).narrow(0, piece.offset, piece.numel);
}

void ParameterShards::follow_parameters() {
  if (!masters_) {
    return;
  }
  at::NoGradGuard no_grad;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const at::Tensor piece = piece_of_parameter(s);
    const at::Tensor written = shards_[s].to(piece.scalar_type()).ne(piece);
    shards_[s].copy_(at::where(written, piece.to(shards_[s].scalar_type()), shards_[s]));
  }
}

void ParameterShards::release_gradients() {
  for (auto& shard : shards_) {
    shard.mutable_grad().reset();
  }
  if (gradients_) {
    gradients_->release();
  }
}

void ParameterShards::zero_gradients() {
  release_gradients();
  if (gradients_) {
    gradients_->zero_grad();
  }
}

void ParameterShards::gather_parameters() {
  wait_for_parameters();
  at::NoGradGuard no_grad;
  const auto& pieces = layout_.pieces;
  if (masters_) {
    for (size_t s = 0; s < pieces.size(); ++s) {
      piece_of_parameter(s).copy_(shards_[s]);
    }
  }
  if (sharded_) {  // (ZeRO-3) each unit's next use gathers the new values
    gradients_->free_parameters();
    return;
  }
  if (group_->getSize() == 1) {
    return;  // the shards are the whole parameters
  }
  const int64_t rank = group_->getRank();
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {  // every bucket on the way, then wait
    const int64_t chunk = layout_.buckets[b].chunk;
    gathering_[b] =
        comm::start_all_gather_into(flat_[b], flat_[b].narrow(0, rank * chunk, chunk), group_);
  }
  if (!overlap_param_gather_) {
    wait_for_parameters();
  }
}

void ParameterShards::wait_for_parameters() const {
  for (auto& work : gathering_) {
    if (work) {
      auto pending = std::move(work);
      work.reset();
      comm::wait(pending, group_, "all_gather (of the parameters)");
    }
  }
}

at::Tensor ParameterShards::gather_bucket(const ShardBucket& bucket,
                                          const std::vector<at::Tensor>& per_shard,
                                          at::ScalarType dtype) const {
  const auto options = at::TensorOptions().dtype(dtype).device(bucket.device);
  at::Tensor mine = at::zeros({bucket.chunk}, options);
  for (size_t k = 0; k < bucket.pieces.size(); ++k) {
    const at::Tensor& value = per_shard[bucket.pieces[k]];
    if (value.defined()) {
      mine.narrow(0, bucket.piece_starts[k], value.numel()).copy_(value.reshape({-1}));
    }
  }
  at::Tensor all = at::empty({bucket.chunk * group_->getSize()}, options);
  comm::all_gather_into(all, mine, group_);
  return all;
}

size_t ParameterShards::pending_gathers() const {
  return static_cast<size_t>(
      std::count_if(gathering_.begin(), gathering_.end(), [](const auto& w) { return bool(w); }));
}

void ParameterShards::wait_for_bucket(size_t bucket) const {
  if (bucket < gathering_.size() && gathering_[bucket]) {
    auto pending = std::move(gathering_[bucket]);
    gathering_[bucket].reset();
    comm::wait(pending, group_, "all_gather (of the parameters)");
  }
}

std::vector<at::Tensor> ParameterShards::gather(const std::vector<at::Tensor>& per_shard) const {
  wait_for_parameters();
  TORCH_CHECK(per_shard.size() == layout_.pieces.size(),
              "ParameterShards::gather: ",
              per_shard.size(),
              " tensors for ",
              layout_.pieces.size(),
              " shards");
  std::vector<at::Tensor> whole(parameters_.size());
  for (const ShardBucket& bucket : layout_.buckets) {
    const at::Tensor all = gather_bucket(bucket, per_shard, shard_dtype(bucket));
    for (size_t j = 0; j < bucket.parameters.size(); ++j) {
      const auto shape = this->shape(bucket.parameters[j]);
      whole[bucket.parameters[j]] =
          all.narrow(0, bucket.starts[j], c10::multiply_integers(shape)).view(shape);
    }
  }
  return whole;
}

std::vector<at::Tensor> ParameterShards::slice(const std::vector<at::Tensor>& per_parameter) const {
  wait_for_parameters();
  TORCH_CHECK(per_parameter.size() == parameters_.size(),
              "ParameterShards::slice: ",
              per_parameter.size(),
              " tensors for ",
              parameters_.size(),
              " parameters");
  std::vector<at::Tensor> pieces;
  pieces.reserve(layout_.pieces.size());
  for (const ShardPiece& piece : layout_.pieces) {
    const at::Tensor& value = per_parameter[piece.parameter];
    if (!value.defined()) {
      pieces.emplace_back();
      continue;
    }
    TORCH_CHECK(value.numel() == c10::multiply_integers(shape(piece.parameter)),
                "DistributedOptimizer: a state tensor of parameter ",
                piece.parameter,
                " has ",
                value.numel(),
                " elements, the parameter ",
                c10::multiply_integers(shape(piece.parameter)));
    pieces.push_back(flat_view(value).narrow(0, piece.offset, piece.numel).clone());
  }
  return pieces;
}

}  // namespace torch_mp::optim
