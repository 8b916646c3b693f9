#include "torch_mp/pipeline/executor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>

#include "torch_mp/collectives.h"
#include "torch_mp/pipeline/p2p.h"

namespace torch_mp::pipeline {
namespace {

// "[Float[4, 16], Long[4]]"
std::string describe(const std::vector<at::Tensor>& tensors) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < tensors.size(); ++i) {
    out << (i ? ", " : "") << tensors[i].scalar_type() << tensors[i].sizes();
  }
  out << "]";
  return out.str();
}

// Leaves that stand for a received (or same-rank) stage input, so backward stops at the stage.
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

bool is_recv(const Action& a) {
  return a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward;
}

bool is_send(const Action& a) {
  return a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward;
}

// The message a receive takes: RECV_F(s,m) <- SEND_F(s-1,m), RECV_B(s,m) <- SEND_B(s+1,m); and
// the receive a send feeds.
Action sender_of(const Action& recv) {
  return recv.kind == ActionKind::kRecvForward
             ? Action{ActionKind::kSendForward, recv.stage - 1, recv.microbatch}
             : Action{ActionKind::kSendBackward, recv.stage + 1, recv.microbatch};
}

Action receiver_of(const Action& send) {
  return send.kind == ActionKind::kSendForward
             ? Action{ActionKind::kRecvForward, send.stage + 1, send.microbatch}
             : Action{ActionKind::kRecvBackward, send.stage - 1, send.microbatch};
}

// When `rank`'s sends are known to be complete: a send is, once a message arrives that its
// peer sent after taking it. Gloo's send works do not say they completed until waited on, so
// this is when their buffers can go (not at the end of the step). By index in lists[rank]: the
// receive, then the sends it releases.
std::map<size_t, std::vector<size_t>> sends_released_by(
    const std::vector<std::vector<Action>>& lists, const Schedule& schedule, int64_t rank) {
  std::vector<std::map<std::tuple<ActionKind, int64_t, int64_t>, size_t>> position(lists.size());
  for (size_t r = 0; r < lists.size(); ++r) {
    for (size_t i = 0; i < lists[r].size(); ++i) {
      const Action& a = lists[r][i];
      position[r][{a.kind, a.stage, a.microbatch}] = i;
    }
  }
  auto at = [&](int64_t r, const Action& a) {
    const auto it = position[r].find({a.kind, a.stage, a.microbatch});
    return it == position[r].end() ? std::optional<size_t>() : std::optional<size_t>(it->second);
  };
  std::map<size_t, std::vector<size_t>> released;
  const auto& mine = lists[rank];
  for (size_t i = 0; i < mine.size(); ++i) {
    if (!is_send(mine[i])) {
      continue;
    }
    const Action taken = receiver_of(mine[i]);
    const int64_t peer = schedule.rank_of_stage(taken.stage);
    const auto taken_at = at(peer, taken);
    if (!taken_at) {
      continue;
    }
    for (size_t j = i + 1; j < mine.size(); ++j) {
      if (!is_recv(mine[j])) {
        continue;
      }
      const Action sent = sender_of(mine[j]);
      if (schedule.rank_of_stage(sent.stage) != peer) {
        continue;
      }
      const auto sent_at = at(peer, sent);
      if (sent_at && *sent_at > *taken_at) {
        released[j].push_back(i);
        break;
      }
    }
  }
  return released;
}

// The forward half of an action list (evaluation).
std::vector<Action> forward_only(const std::vector<Action>& actions) {
  std::vector<Action> out;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
        a.kind == ActionKind::kRecvForward) {
      out.push_back(a);
    }
  }
  return out;
}

// An exception's text without C++ backtrace.
std::string text_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

bool mentions_any(const std::string& text, std::initializer_list<const char*> words) {
  for (const char* word : words) {
    if (text.find(word) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// Gloo's words for a peer that never answered.
bool timed_out(const std::string& text) { return mentions_any(text, {"Timed out", "timed out"}); }

// Gloo's words for a peer whose connection went away (its process died, most often).
bool lost_peer(const std::string& text) {
  return mentions_any(text,
                      {"Connection closed",
                       "closed by peer",
                       "Connection reset",
                       "Broken pipe",
                       "Connection refused",
                       "connection closed"});
}

// Pipelines this process has built (see Executor::pipeline_id_).
std::atomic<int64_t> pipelines_built{0};

// Gloo tags are 31-bit; each (pipeline, step) gets its own range of them while they last.
constexpr int64_t kMaxTag = std::numeric_limits<int32_t>::max();

}  // namespace

std::vector<std::vector<at::Tensor>> split_microbatches(const std::vector<at::Tensor>& batch,
                                                        int64_t num_microbatches) {
  TORCH_CHECK(
      num_microbatches > 0, "Pipeline: num_microbatches must be positive, got ", num_microbatches);
  std::vector<std::vector<at::Tensor>> result(num_microbatches);
  for (const auto& t : batch) {
    TORCH_CHECK(t.dim() > 0 && t.size(0) % num_microbatches == 0,
                "Pipeline: the batch size (",
                t.dim() > 0 ? t.size(0) : 0,
                ") of a ",
                describe({t}),
                " tensor must be divisible by num_microbatches (",
                num_microbatches,
                ")");
    auto chunks = t.chunk(num_microbatches, 0);
    for (int64_t m = 0; m < num_microbatches; ++m) {
      result[m].push_back(chunks[m]);
    }
  }
  return result;
}

Executor::Executor(Schedule schedule, std::vector<Stage> stages, LossFn loss, GroupPtr group)
    : schedule_(std::move(schedule)),
      stages_(std::move(stages)),
      loss_(std::move(loss)),
      group_(std::move(group)) {
  TORCH_CHECK(group_, "Pipeline: no pipeline process group");
  rank_ = group_->getRank();
  // Agreement first, so that a local check failing on one rank cannot strand the others.
  std::ostringstream described;
  described << "schedule " << schedule_.name << " (num_stages=" << schedule_.num_stages
            << ", num_microbatches=" << schedule_.num_microbatches
            << ", stages_per_rank=" << schedule_.stages_per_rank << ", actions digest "
            << (std::hash<std::string>{}(schedule_.to_string()) % 1000000007) << ") with "
            << stages_.size() << " stage module(s) per rank";
  comm::check_same_text_across_ranks(described.str(), group_, "Pipeline: the pipeline");
  // Sends and receives are posted one tensor at a time and may cross between two ranks: fine
  // for Gloo, but NCCL needs them grouped, which is not built yet.
  TORCH_CHECK(group_->getBackendType() != c10d::ProcessGroup::BackendType::NCCL,
              "Pipeline: NCCL pipeline groups are not supported yet; use a Gloo group");
  TORCH_CHECK(schedule_.num_ranks() == group_->getSize(),
              "Pipeline: the schedule is for ",
              schedule_.num_ranks(),
              " pipeline ranks but the pipeline group has ",
              group_->getSize());
  TORCH_CHECK(static_cast<int64_t>(stages_.size()) == schedule_.stages_per_rank,
              "Pipeline: rank ",
              rank_,
              " was given ",
              stages_.size(),
              " stage module(s), but the schedule puts ",
              schedule_.stages_per_rank,
              " stage(s) on each rank");
  simulate(schedule_);  // raises, naming rank, step and action, if the schedule cannot run
  agree_on_id();
  released_by_[1] = sends_released_by(schedule_.actions, schedule_, rank_);
  std::vector<std::vector<Action>> forward_lists;
  for (const auto& list : schedule_.actions) {
    forward_lists.push_back(forward_only(list));
  }
  released_by_[0] = sends_released_by(forward_lists, schedule_, rank_);
  last_backward_.resize(stages_.size());
  const auto& mine = schedule_.actions[rank_];
  for (size_t i = 0; i < mine.size(); ++i) {
    auto& last = last_backward_[mine[i].stage / schedule_.num_ranks()];
    switch (mine[i].kind) {
      case ActionKind::kFullBackward:
        last.full = i;
        break;
      case ActionKind::kBackwardInput:
        last.input = i;
        break;
      case ActionKind::kBackwardWeight:
        last.weight = i;
        break;
      default:
        break;
    }
  }
  for (const auto& stage : stages_) {
    if (!stage.parameters.empty()) {
      device_ = stage.parameters[0].device();
      break;
    }
  }
}

void Executor::agree_on_id() {
  // One id for this Pipeline on every rank of the group, whatever each built before.
  pipeline_id_ =
      comm::all_reduce(
          at::scalar_tensor(pipelines_built.load(), at::kLong), group_, c10d::ReduceOp::MAX)
          .item<int64_t>();
  pipelines_built = pipeline_id_ + 1;
}

Stage& Executor::local(int64_t stage) { return stages_[stage / schedule_.num_ranks()]; }

int64_t Executor::message_of(const Action& a) const {
  // A message is named by its sender: SEND_F(s) <-> RECV_F(s + 1), SEND_B(s) <-> RECV_B(s - 1).
  const bool forward = a.kind == ActionKind::kSendForward || a.kind == ActionKind::kRecvForward;
  const int64_t sender = a.kind == ActionKind::kRecvForward    ? a.stage - 1
                         : a.kind == ActionKind::kRecvBackward ? a.stage + 1
                                                               : a.stage;
  return ((forward ? 0 : 1) * schedule_.num_stages + sender) * schedule_.num_microbatches +
         a.microbatch;
}

int Executor::tag(int64_t message) const {
  const int64_t messages = 2 * schedule_.num_stages * schedule_.num_microbatches;
  const int64_t epochs = std::max<int64_t>(1, kMaxTag / kTagsPerMessage / messages);
  const int64_t epoch = (pipeline_id_ * 1000003 + steps_run_) % epochs;
  return static_cast<int>((epoch * messages + message) * kTagsPerMessage);
}

void Executor::post(const std::vector<Action>& actions, size_t index) {
  const Action& a = actions[index];
  const int64_t sender = a.kind == ActionKind::kRecvForward ? a.stage - 1 : a.stage + 1;
  const int64_t message = message_of(a);
  posted_recvs_.emplace(index,
                        post_recv(static_cast<int>(schedule_.rank_of_stage(sender)),
                                  tag(message),
                                  group_,
                                  device_,
                                  recv_channels_[message]));
}

std::string Executor::where(const Action& a) const {
  std::ostringstream out;
  out << "rank " << rank_ << "'s " << a.to_string();
  return out.str();
}

void Executor::forward(const Action& a,
                       Slot& slot,
                       const std::vector<std::vector<at::Tensor>>& inputs,
                       const std::vector<std::vector<at::Tensor>>& targets,
                       bool train,
                       std::vector<std::vector<at::Tensor>>* outputs) {
  const int64_t s = a.stage;
  const int64_t m = a.microbatch;
  if (s == 0) {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == schedule_.num_microbatches,
                "Pipeline: rank ",
                rank_,
                " holds the first stage and must be given the inputs");
    slot.inputs = as_stage_inputs(inputs[m], /*train=*/false);  // the batch gets no gradient
  } else if (schedule_.rank_of_stage(s - 1) == rank_) {
    slot.inputs = as_stage_inputs(slots_.at({s - 1, m}).outputs, train);
  }
  std::vector<at::Tensor> out;
  try {
    out = local(s).forward(slot.inputs);
  } catch (const std::exception& e) {
    std::ostringstream from;
    if (s > 0) {
      from << " from stage " << s - 1 << " (rank " << schedule_.rank_of_stage(s - 1) << ")";
    }
    TORCH_CHECK(false,
                "Pipeline: stage ",
                s,
                " (rank ",
                rank_,
                ") failed on micro-batch ",
                m,
                " in ",
                a.to_string(),
                " given ",
                describe(slot.inputs),
                from.str(),
                ": ",
                text_of(e));
  }
  require_finite(out, a, "output");
  if (s < schedule_.num_stages - 1) {
    slot.outputs = std::move(out);
    return;
  }
  if (outputs) {
    outputs->push_back(out);
  }
  if (targets.empty() && !train) {
    return;  // evaluation without a loss
  }
  TORCH_CHECK(static_cast<int64_t>(targets.size()) == schedule_.num_microbatches,
              "Pipeline: rank ",
              rank_,
              " holds the last stage and must be given target=");
  const auto loss_inputs = train ? as_stage_inputs(out, true) : out;
  at::Tensor loss;
  try {
    loss = loss_(loss_inputs, targets[m]);
  } catch (const std::exception& e) {
    TORCH_CHECK(false,
                "Pipeline: loss_fn failed on micro-batch ",
                m,
                " in ",
                a.to_string(),
                " (last stage ",
                s,
                ", rank ",
                rank_,
                ") given ",
                describe(loss_inputs),
                " and targets ",
                describe(targets[m]),
                ": ",
                text_of(e));
  }
  TORCH_CHECK(loss.numel() == 1,
              "Pipeline: the loss function must return a scalar, got shape ",
              loss.sizes());
  require_finite({loss}, a, "loss");
  losses_.push_back(loss.detach().reshape({}));
  if (train) {
    slot.outputs = std::move(out);
    slot.loss = loss.reshape({}) / static_cast<double>(schedule_.num_microbatches);
    slot.loss_inputs = loss_inputs;
  }
}

std::vector<at::Tensor> Executor::gradients_for(const Action& a, Slot& slot) {
  if (a.stage == schedule_.num_stages - 1) {
    // The gradient of the loss with respect to the stage's outputs (zeros where it has none).
    std::vector<at::Tensor> wrt;
    for (const auto& t : slot.loss_inputs) {
      if (t.requires_grad()) {
        wrt.push_back(t);
      }
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
  if (schedule_.rank_of_stage(a.stage + 1) == rank_) {
    return slots_.at({a.stage + 1, a.microbatch}).input_grads;
  }
  return slot.output_grads;
}

void Executor::backward(const Action& a, size_t index, Slot& slot) {
  auto grads = gradients_for(a, slot);
  // Only outputs that take part in autograd get a gradient.
  std::vector<at::Tensor> outs;
  std::vector<at::Tensor> out_grads;
  for (size_t i = 0; i < slot.outputs.size(); ++i) {
    if (slot.outputs[i].requires_grad()) {
      outs.push_back(slot.outputs[i]);
      if (!grads.empty()) {
        out_grads.push_back(grads.at(i));
      }
    }
  }
  std::vector<at::Tensor> leaves;
  std::vector<size_t> leaf_index;
  for (size_t i = 0; i < slot.inputs.size(); ++i) {
    if (slot.inputs[i].requires_grad()) {
      leaves.push_back(slot.inputs[i]);
      leaf_index.push_back(i);
    }
  }
  std::vector<at::Tensor> computed(slot.inputs.size());
  // Without input gradients to produce (the first stage), a split B has nothing of its own to
  // do and W would walk the whole graph; running the whole backward at B leaves W nothing.
  if (a.kind == ActionKind::kFullBackward || leaves.empty()) {
    if (!outs.empty()) {
      before_accumulating(a, index);
      torch::autograd::backward(outs, out_grads);
    }
    for (size_t j = 0; j < leaves.size(); ++j) {
      computed[leaf_index[j]] = leaves[j].grad();
    }
    slot.outputs.clear();
    slot.output_grads.clear();
  } else {
    // B: the input gradients only; what W needs is kept in the slot.
    if (!outs.empty()) {
      const auto g =
          backward_input(outs, out_grads, leaves, local(a.stage).parameters, slot.weight_work);
      for (size_t j = 0; j < leaves.size(); ++j) {
        computed[leaf_index[j]] = g[j];
      }
      slot.weight_pending = true;
    }
    slot.outputs.clear();
    slot.output_grads.clear();
  }
  slot.input_grads = input_gradients(slot.inputs, computed);
  require_finite(slot.input_grads, a, "input gradient");
  slot.inputs.clear();
}

void Executor::weight(const Action& a, size_t index, Slot& slot) {
  if (slot.weight_pending) {
    before_accumulating(a, index);
    backward_weight(slot.weight_work);
    slot.weight_pending = false;
  }
}

void Executor::require_finite(const std::vector<at::Tensor>& tensors,
                              const Action& a,
                              const char* what) const {
  if (!check_finite_) {
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.defined() && t.is_floating_point() && !at::isfinite(t).all().item<bool>()) {
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
                  rank_,
                  ": ",
                  nans,
                  " NaN and ",
                  t.numel() - nans - at::isfinite(t).sum().item<int64_t>(),
                  " infinite entries (check_finite)");
    }
  }
}

void Executor::before_accumulating(const Action& a, size_t index) {
  const int64_t local_index = a.stage / schedule_.num_ranks();
  const Stage& stage = stages_[local_index];
  if (!stage.arm_gradient_sync) {
    return;
  }
  // A wrong gradient is worse than an error: nothing may accumulate once the reduction began.
  TORCH_CHECK(!sync_armed_[local_index],
              "Pipeline: stage ",
              a.stage,
              " (rank ",
              rank_,
              ") accumulates parameter gradients at ",
              a.to_string(),
              " after its data-parallel reduction started; this schedule cannot be combined with "
              "data parallelism");
  const auto& last = last_backward_[local_index];
  const size_t last_index = a.kind == ActionKind::kFullBackward    ? last.full
                            : a.kind == ActionKind::kBackwardInput ? last.input
                                                                   : last.weight;
  if (index == last_index) {
    stage.arm_gradient_sync();
    sync_armed_[local_index] = true;
  }
}

std::optional<at::Tensor> Executor::run(const std::vector<Action>& actions,
                                        const std::vector<std::vector<at::Tensor>>& inputs,
                                        const std::vector<std::vector<at::Tensor>>& targets,
                                        bool train,
                                        std::vector<std::vector<at::Tensor>>* outputs) {
  TORCH_CHECK(!broken_,
              "Pipeline: a step failed (on rank ",
              rank_,
              " or another); call reset() on every rank of the pipeline before the next step");
  slots_.clear();
  losses_.clear();
  trace_.clear();
  pending_sends_.clear();
  broken_ = true;  // until this step completes on every rank
  ++steps_run_;
  sync_armed_.assign(stages_.size(), false);
  posted_recvs_.clear();
  next_recv_ = 0;
  auto post_next = [&] {
    while (next_recv_ < actions.size() && !is_recv(actions[next_recv_])) {
      ++next_recv_;
    }
    if (next_recv_ < actions.size()) {
      post(actions, next_recv_++);
    }
  };
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  const auto& released = released_by_[train ? 1 : 0];
  size_t index = 0;
  try {
    for (size_t i = 0; i < kRecvsAhead; ++i) {
      post_next();
    }
    for (; index < actions.size(); ++index) {
      const Action& a = actions[index];
      const double began = seconds();
      Slot& slot = slots_[{a.stage, a.microbatch}];
      switch (a.kind) {
        case ActionKind::kRecvForward:
        case ActionKind::kRecvBackward: {
          auto received = finish_recv(posted_recvs_.at(index),
                                      group_,
                                      device_,
                                      {pipeline_id_, steps_run_},
                                      where(a),
                                      recv_channels_[message_of(a)]);
          posted_recvs_.erase(index);
          post_next();
          if (const auto it = released.find(index); it != released.end()) {
            std::erase_if(pending_sends_, [&](const auto& send) {
              if (std::find(it->second.begin(), it->second.end(), send.second) ==
                  it->second.end()) {
                return false;
              }
              send.first->wait();  // done already: the peer has answered since
              return true;
            });
          }
          if (a.kind == ActionKind::kRecvForward) {
            slot.inputs = as_stage_inputs(received, train);
          } else {
            slot.output_grads = std::move(received);
          }
          break;
        }
        case ActionKind::kSendForward:
        case ActionKind::kSendBackward: {
          const bool fwd = a.kind == ActionKind::kSendForward;
          auto works =
              send_tensors(fwd ? slot.outputs : slot.input_grads,
                           static_cast<int>(schedule_.rank_of_stage(a.stage + (fwd ? 1 : -1))),
                           tag(message_of(a)),
                           group_,
                           {pipeline_id_, steps_run_},
                           send_channels_[message_of(a)]);
          for (auto& work : works) {
            pending_sends_.emplace_back(std::move(work), index);
          }
          if (!fwd) {
            slot.input_grads.clear();  // the pending work holds what it still needs
          }
          break;
        }
        case ActionKind::kForward:
          forward(a, slot, inputs, targets, train, outputs);
          break;
        case ActionKind::kBackwardInput:
        case ActionKind::kFullBackward:
          backward(a, index, slot);
          break;
        case ActionKind::kBackwardWeight:
          weight(a, index, slot);
          break;
      }
      trace_.push_back({rank_, a, began, seconds()});
    }
    for (auto& [work, send_index] : pending_sends_) {
      index = send_index;  // a send that fails names its action and peer
      work->wait();
    }
    index = actions.size();
    if (train) {
      const auto mine = schedule_.stages_of_rank(rank_);
      for (size_t i = 0; i < stages_.size(); ++i) {
        TORCH_CHECK(!stages_[i].arm_gradient_sync || sync_armed_[i],
                    "Pipeline: stage ",
                    mine[i],
                    " (rank ",
                    rank_,
                    ") never reached the backward that reduces its data-parallel gradients");
      }
    }
  } catch (const PeerFailure& e) {
    fail(actions, index, e);
  } catch (const std::exception& e) {
    fail(actions, index, failure_of(actions, index, e));
  }
  pending_sends_.clear();
  slots_.clear();
  agree(std::nullopt);
  broken_ = false;
  if (losses_.empty()) {
    return std::nullopt;
  }
  return at::stack(losses_).mean();
}

PeerFailure Executor::failure_of(const std::vector<Action>& actions,
                                 size_t index,
                                 const std::exception& e) const {
  const std::string text = text_of(e);
  const bool broken = timed_out(text) || lost_peer(text);
  std::ostringstream out;
  if (index >= actions.size()) {  // after the last action (the step's closing checks)
    out << (text.rfind("Pipeline: ", 0) == 0 ? "" : "Pipeline: ") << text;
    return PeerFailure(out.str(), rank_, broken);
  }
  const Action& a = actions[index];
  const bool forward = a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kSendForward;
  const int64_t neighbour =
      forward ? a.stage + (is_recv(a) ? -1 : 1) : a.stage + (is_recv(a) ? 1 : -1);
  if ((is_recv(a) || is_send(a)) && broken) {
    const int64_t peer = schedule_.rank_of_stage(neighbour);
    out << "Pipeline: rank " << rank_ << "'s " << a.to_string() << (is_recv(a) ? " from" : " to")
        << " rank " << peer << " (stage " << neighbour << ") ";
    if (timed_out(text)) {
      out << "got no answer within the group's timeout: rank " << peer
          << " stalled, is slow, or failed without telling its peers";
    } else {
      out << "lost its connection to rank " << peer << " (did its process die?)";
    }
    out << ": " << text;
  } else if (text.rfind("Pipeline: ", 0) == 0 || text.rfind("torch_mp.pipeline: ", 0) == 0) {
    out << text;  // already names the rank, stage and micro-batch
  } else {
    out << "Pipeline: rank " << rank_ << ", stage " << a.stage << ", micro-batch " << a.microbatch
        << ": " << a.to_string() << " failed: " << text;
  }
  return PeerFailure(out.str(), rank_, broken);
}

void Executor::fail(const std::vector<Action>& actions, size_t index, const PeerFailure& failure) {
  // Every message still owed becomes a failure marker: the peers waiting for them raise now.
  std::map<int64_t, std::vector<c10::intrusive_ptr<c10d::Work>>> first_marker;  // by peer
  for (size_t j = index; j < actions.size(); ++j) {
    const Action& a = actions[j];
    if (!is_send(a)) {
      continue;
    }
    const int64_t neighbour = a.stage + (a.kind == ActionKind::kSendForward ? 1 : -1);
    try {
      auto works = send_failure(failure,
                                static_cast<int>(schedule_.rank_of_stage(neighbour)),
                                tag(message_of(a)),
                                group_,
                                {pipeline_id_, steps_run_},
                                send_channels_[message_of(a)],
                                device_);
      first_marker.emplace(schedule_.rank_of_stage(neighbour), works);
      orphans_.insert(orphans_.end(), works.begin(), works.end());
    } catch (const std::exception&) {
      // A peer whose connection is gone cannot be told.
    }
  }
  if (failure.group_broken) {
    // No agreement follows (the group is broken), and this process may exit as soon as the
    // error is raised: give each peer's first marker (the message it waits for, usually) a
    // moment to leave, so that the peer learns what failed rather than that this rank is gone.
    // Not the peer this rank lost or learnt the failure from.
    if (index < actions.size() && (is_recv(actions[index]) || is_send(actions[index]))) {
      const Action& a = actions[index];
      const bool towards_next =
          a.kind == ActionKind::kSendForward || a.kind == ActionKind::kRecvBackward;
      first_marker.erase(schedule_.rank_of_stage(a.stage + (towards_next ? 1 : -1)));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (const auto& [peer, works] : first_marker) {
      try {
        for (const auto& work : works) {  // the marker, then what failed
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
              deadline - std::chrono::steady_clock::now());
          work->wait(std::max(left, std::chrono::milliseconds(1)));
        }
      } catch (const std::exception&) {
        // Not taken in time (the peer waits for something else): it learns at its timeout.
      }
    }
  }
  abandon_in_flight();
  if (!failure.group_broken) {
    try {
      agree(failure);
    } catch (const std::exception&) {
      // The agreement failing (a peer died meanwhile) must not hide what failed here.
    }
  }
  if (failure.origin == rank_) {
    TORCH_CHECK(false, failure.what());
  }
  const Action& a = actions[std::min(index, actions.size() - 1)];
  TORCH_CHECK(false,
              "Pipeline: rank ",
              rank_,
              " stopped at ",
              a.to_string(),
              " because the step failed on rank ",
              failure.origin,
              ": ",
              failure.what());
}

void Executor::agree(const std::optional<PeerFailure>& failure) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  int64_t first = kNone;
  try {
    first = comm::all_reduce(at::scalar_tensor(failure ? failure->origin : kNone, at::kLong),
                             group_,
                             c10d::ReduceOp::MIN)
                .item<int64_t>();
  } catch (const std::exception& e) {
    if (failure) {
      throw;
    }
    TORCH_CHECK(false,
                "Pipeline: rank ",
                rank_,
                " finished its step, but could not agree on it with its peers (one failed and "
                "left the group broken, stalled, or died): ",
                text_of(e));
  }
  if (first == kNone) {
    return;
  }
  // The first failure's text, from its rank.
  auto text = at::zeros({4096}, at::kByte);
  if (failure && failure->origin == first && rank_ == first) {
    const std::string message = failure->what();
    std::memcpy(text.data_ptr<uint8_t>(), message.data(), std::min<size_t>(message.size(), 4095));
  }
  std::vector<at::Tensor> buffer{text.to(device_)};
  c10d::BroadcastOptions options;
  options.rootRank = first;
  group_->broadcast(buffer, options)->wait();
  if (!failure) {
    const auto received = buffer[0].cpu();
    const auto* chars = reinterpret_cast<const char*>(received.data_ptr<uint8_t>());
    TORCH_CHECK(false,
                "Pipeline: rank ",
                rank_,
                " finished its step, but the step failed on rank ",
                first,
                ": ",
                std::string(chars, strnlen(chars, 4096)));
  }
}

void Executor::abandon_in_flight() {
  for (auto& [work, send_index] : pending_sends_) {
    orphans_.push_back(work);
  }
  pending_sends_.clear();
  for (auto& [i, pending] : posted_recvs_) {
    orphans_.push_back(pending.work);
  }
  posted_recvs_.clear();
  slots_.clear();
}

void Executor::reset(GroupPtr group) {
  if (group && group != group_) {
    TORCH_CHECK(group->getSize() == group_->getSize() && group->getRank() == group_->getRank(),
                "Pipeline.reset: the new group must have this rank and size (",
                group_->getRank(),
                " of ",
                group_->getSize(),
                "), got ",
                group->getRank(),
                " of ",
                group->getSize());
    old_groups_.push_back(std::move(group_));
    group_ = std::move(group);
  }
  abandon_in_flight();
  send_channels_.clear();
  recv_channels_.clear();
  agree_on_id();
  steps_run_ = 0;
  broken_ = false;
}

std::optional<at::Tensor> Executor::step(const std::vector<std::vector<at::Tensor>>& inputs,
                                         const std::vector<std::vector<at::Tensor>>& targets) {
  return run(schedule_.actions[rank_], inputs, targets, /*train=*/true, nullptr);
}

std::pair<std::vector<at::Tensor>, std::optional<at::Tensor>> Executor::eval_step(
    const std::vector<std::vector<at::Tensor>>& inputs,
    const std::vector<std::vector<at::Tensor>>& targets) {
  at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> per_microbatch;
  auto loss = run(
      forward_only(schedule_.actions[rank_]), inputs, targets, /*train=*/false, &per_microbatch);
  std::vector<at::Tensor> outputs;
  for (size_t i = 0; !per_microbatch.empty() && i < per_microbatch[0].size(); ++i) {
    std::vector<at::Tensor> parts;
    for (const auto& mb : per_microbatch) {
      parts.push_back(mb[i]);
    }
    outputs.push_back(at::cat(parts, 0));
  }
  return {outputs, loss};
}

}  // namespace torch_mp::pipeline
