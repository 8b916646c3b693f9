// The run loop (executor.h): the interpreter of a rank's action list, one handler per kind of
// action.

#include "torch_mp/pipeline/executor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>  // Node: dropping a Slot drops its WeightWork

#include <algorithm>
#include <chrono>
#include <functional>
#include <sstream>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"

namespace torch_mp::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// "rank 1's RECV_F(1,0)": a receive, as its errors name it.
std::string where(int64_t rank, const Action& a) {
  std::ostringstream out;
  out << "rank " << rank << "'s " << a.to_string();
  return out.str();
}

// The device of the first stage with parameters (the group's without any).
at::Device device_of(const std::vector<Stage>& stages, const GroupPtr& group) {
  for (const auto& stage : stages) {
    if (!stage.parameters.empty()) {
      return stage.parameters[0].device();
    }
  }
  return torch_mp::device_of(group);
}

// Evaluation's schedule: the forward half of every list (under NCCL's rules, made safe again).
Schedule forward_schedule(const Schedule& schedule, bool ordered) {
  Schedule forward = schedule;
  for (auto& list : forward.actions) {
    list = forward_only(list);
  }
  return ordered ? make_nccl_safe(std::move(forward)) : forward;
}

}  // namespace

Executor::Executor(Schedule schedule, std::vector<Stage> stages, LossFn loss, GroupPtr group)
    : schedule_(std::move(schedule)), stages_(std::move(stages)), loss_(std::move(loss)) {
  TORCH_CHECK(group, "Pipeline: no pipeline process group");
  rank_ = group->getRank();
  mailbox_.device = device_of(stages_, group);
  mailbox_.ordered = is_nccl(group) || check_collectives();
  mailbox_.group = std::move(group);
  check_fits();
  if (mailbox_.ordered) {
    schedule_ = make_nccl_safe(std::move(schedule_));
  }
  // Raises, naming rank, step and action, if the schedule cannot run.
  simulate(schedule_, {}, mailbox_.ordered ? CommSemantics::kNccl : CommSemantics::kGloo);
  mailbox_.agree_on_pipeline_id();
  training_ = plan_actions(schedule_, rank_, /*train=*/true);
  evaluation_ = plan_actions(forward_schedule(schedule_, mailbox_.ordered), rank_, /*train=*/false);
  mailbox_.messages_per_step = 2 * schedule_.num_stages * schedule_.num_microbatches;
}

void Executor::check_fits() const {
  const GroupPtr& group = mailbox_.group;
  // Agreement first, so that a local check failing on one rank cannot strand the others.
  std::ostringstream described;
  described << "schedule " << schedule_.name << " (num_stages=" << schedule_.num_stages
            << ", num_microbatches=" << schedule_.num_microbatches
            << ", stages_per_rank=" << schedule_.stages_per_rank << ", actions digest "
            << (std::hash<std::string>{}(schedule_.to_string()) % 1000000007) << ") with "
            << stages_.size() << " stage module(s) per rank"
            << (mailbox_.ordered ? ", under NCCL's rules" : ", under Gloo's rules");
  comm::check_same_text_across_ranks(described.str(), group, "Pipeline: the pipeline");
  TORCH_CHECK(schedule_.num_ranks() == group->getSize(),
              "Pipeline: the schedule is for ",
              schedule_.num_ranks(),
              " pipeline ranks but the pipeline group has ",
              group->getSize());
  TORCH_CHECK(static_cast<int64_t>(stages_.size()) == schedule_.stages_per_rank,
              "Pipeline: rank ",
              rank_,
              " was given ",
              stages_.size(),
              " stage module(s), but the schedule puts ",
              schedule_.stages_per_rank,
              " stage(s) on each rank");
}

std::optional<at::Tensor> Executor::step(const std::vector<std::vector<at::Tensor>>& inputs,
                                         const std::vector<std::vector<at::Tensor>>& targets) {
  return run(training_, {inputs, targets, /*train=*/true, nullptr});
}

std::pair<std::vector<at::Tensor>, std::optional<at::Tensor>> Executor::eval_step(
    const std::vector<std::vector<at::Tensor>>& inputs,
    const std::vector<std::vector<at::Tensor>>& targets) {
  at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> per_microbatch;
  auto loss = run(evaluation_, {inputs, targets, /*train=*/false, &per_microbatch});
  return {join_microbatches(per_microbatch), loss};
}

std::optional<at::Tensor> Executor::run(const ActionPlan& plan, const StepArguments& args) {
  TORCH_CHECK(!broken_,
              "Pipeline: a step failed (on rank ",
              rank_,
              " or another); call reset() on every rank of the pipeline before the next step");
  begin_step();
  const auto start = Clock::now();
  size_t index = 0;
  try {
    for (size_t i = 0; i < kRecvsAhead; ++i) {
      post_next_recv(plan);
    }
    for (; index < plan.actions.size(); ++index) {
      const double began = seconds_since(start);
      post_group(plan, index);
      execute(plan, index, args);
      step_.trace.push_back({rank_, plan.actions[index], began, seconds_since(start)});
    }
    for (auto& [work, send_index] : step_.pending_sends) {
      index = send_index;  // a send that fails names its action and peer
      work->wait();
    }
    index = plan.actions.size();
    if (args.train) {
      check_gradient_syncs_armed();
    }
  } catch (const PeerFailure& e) {
    fail(plan, index, e);
  } catch (const std::exception& e) {
    fail(plan, index, failure_of(e, plan, index, rank_));
  }
  return end_step();
}

void Executor::begin_step() {
  step_ = StepState{};
  step_.sync_armed.assign(stages_.size(), false);
  broken_ = true;  // until this step completes on every rank
  ++mailbox_.stamp.step;
}

void Executor::execute(const ActionPlan& plan, size_t index, const StepArguments& args) {
  const Action& a = plan.actions[index];
  Slot& slot = step_.slots[{a.stage, a.microbatch}];
  switch (a.kind) {
    case ActionKind::kRecvForward:
    case ActionKind::kRecvBackward:
      return receive(plan, index, slot, args.train);
    case ActionKind::kSendForward:
    case ActionKind::kSendBackward:
      return send(plan, index, slot);
    case ActionKind::kForward:
      return forward(a, slot, args);
    case ActionKind::kBackwardInput:
    case ActionKind::kFullBackward:
      return backward(a, index, slot);
    case ActionKind::kBackwardWeight:
      return weight(a, index, slot);
  }
}

std::optional<at::Tensor> Executor::end_step() {
  step_.pending_sends.clear();
  step_.posted_buffers.clear();
  step_.slots.clear();
  agree_on_step(std::nullopt, mailbox_.group, rank_, mailbox_.device);
  broken_ = false;
  if (step_.losses.empty()) {
    return std::nullopt;
  }
  return at::stack(step_.losses).mean();
}

void Executor::receive(const ActionPlan& plan, size_t index, Slot& slot, bool train) {
  const Action& a = plan.actions[index];
  auto received =
      mailbox_.finish(plan.routes[index], step_.posted_recvs.at(index), where(rank_, a));
  step_.posted_recvs.erase(index);
  post_next_recv(plan);
  release_sends(plan, index);
  if (a.kind == ActionKind::kRecvForward) {
    slot.inputs = as_stage_inputs(received, train);
  } else {
    slot.output_grads = std::move(received);
  }
}

void Executor::send(const ActionPlan& plan, size_t index, Slot& slot) {
  if (!mailbox_.ordered) {
    post_send(plan, index, slot);
  }  // else posted with its group
}

void Executor::post_send(const ActionPlan& plan, size_t index, Slot& slot) {
  const bool forward = plan.actions[index].kind == ActionKind::kSendForward;
  auto works = mailbox_.send(plan.routes[index], forward ? slot.outputs : slot.input_grads);
  for (auto& work : works) {
    step_.pending_sends.emplace_back(std::move(work), index);
  }
  if (!forward) {
    slot.input_grads.clear();  // the pending work holds what it still needs
  }
}

void Executor::forward(const Action& a, Slot& slot, const StepArguments& args) {
  take_inputs(a, slot, args);
  auto outputs = run_forward(local(a.stage), slot.inputs, a, schedule_, rank_);
  check_finite(outputs, a, "output");
  if (a.stage < schedule_.num_stages - 1) {
    slot.outputs = std::move(outputs);
    return;
  }
  if (args.outputs) {
    args.outputs->push_back(outputs);
  }
  if (args.targets.empty() && !args.train) {
    return;  // evaluation without a loss
  }
  TORCH_CHECK(static_cast<int64_t>(args.targets.size()) == schedule_.num_microbatches,
              "Pipeline: rank ",
              rank_,
              " holds the last stage and must be given target=");
  take_loss(a, slot, std::move(outputs), args);
}

void Executor::backward(const Action& a, size_t index, Slot& slot) {
  const auto grads = gradients_for(a, slot);
  run_backward(slot,
               grads,
               /*full=*/a.kind == ActionKind::kFullBackward,
               local(a.stage).parameters,
               [&] { before_accumulating(a, index); });
  check_finite(slot.input_grads, a, "input gradient");
  slot.inputs.clear();
}

void Executor::weight(const Action& a, size_t index, Slot& slot) {
  run_weight(slot, [&] { before_accumulating(a, index); });
}

void Executor::post_next_recv(const ActionPlan& plan) {
  if (mailbox_.ordered || step_.next_recv >= plan.receives.size()) {
    return;  // under NCCL's rules, receives are posted with their group
  }
  const size_t index = plan.receives[step_.next_recv++];
  step_.posted_recvs.emplace(index, mailbox_.post(plan.routes[index]));
}

void Executor::post_group(const ActionPlan& plan, size_t index) {
  const auto group = plan.groups.find(index);
  if (!mailbox_.ordered || group == plan.groups.end()) {
    return;
  }
  const auto& members = group->second;
  const size_t first_send = step_.pending_sends.size();
  comm::P2PGroup batch(mailbox_.group);
  for (size_t i : members) {
    const Action& a = plan.actions[i];
    if (is_send(a)) {
      post_send(plan, i, step_.slots[{a.stage, a.microbatch}]);
    } else {
      step_.posted_recvs.emplace(i, mailbox_.post(plan.routes[i]));
    }
    step_.posted_until = std::max(step_.posted_until, i + 1);
  }
  const auto work = batch.finish();
  for (auto& buffer : batch.take_tensors()) {
    step_.posted_buffers.push_back(std::move(buffer));
  }
  if (work) {  // NCCL: the group's work stands for each of its own
    for (size_t k = first_send; k < step_.pending_sends.size(); ++k) {
      step_.pending_sends[k].first = work;
    }
    for (size_t i : members) {
      if (is_recv(plan.actions[i])) {
        step_.posted_recvs.at(i).work = work;
      }
    }
  }
}

void Executor::release_sends(const ActionPlan& plan, size_t index) {
  const auto it = plan.sends_released_by.find(index);
  if (it == plan.sends_released_by.end()) {
    return;
  }
  const auto& released = it->second;
  std::erase_if(step_.pending_sends, [&](const auto& send) {
    if (std::find(released.begin(), released.end(), send.second) == released.end()) {
      return false;
    }
    send.first->wait();  // done already: the peer has answered since
    return true;
  });
}

void Executor::take_inputs(const Action& a, Slot& slot, const StepArguments& args) {
  const int64_t s = a.stage;
  const int64_t m = a.microbatch;
  if (s == 0) {
    TORCH_CHECK(static_cast<int64_t>(args.inputs.size()) == schedule_.num_microbatches,
                "Pipeline: rank ",
                rank_,
                " holds the first stage and must be given the inputs");
    slot.inputs = as_stage_inputs(args.inputs[m], /*train=*/false);  // the batch gets no gradient
  } else if (schedule_.rank_of_stage(s - 1) == rank_) {
    slot.inputs = as_stage_inputs(step_.slots.at({s - 1, m}).outputs, args.train);
  }
}

void Executor::take_loss(const Action& a,
                         Slot& slot,
                         std::vector<at::Tensor> outputs,
                         const StepArguments& args) {
  const auto loss_inputs = args.train ? as_stage_inputs(outputs, true) : outputs;
  const at::Tensor loss = run_loss(loss_, loss_inputs, args.targets[a.microbatch], a, rank_);
  check_finite({loss}, a, "loss");
  step_.losses.push_back(loss.detach().reshape({}));
  if (!args.train) {
    return;
  }
  slot.outputs = std::move(outputs);
  slot.loss = loss.reshape({}) / static_cast<double>(schedule_.num_microbatches);
  slot.loss_inputs = loss_inputs;
}

std::vector<at::Tensor> Executor::gradients_for(const Action& a, Slot& slot) {
  if (a.stage == schedule_.num_stages - 1) {
    return loss_gradients(slot);
  }
  if (schedule_.rank_of_stage(a.stage + 1) == rank_) {
    return step_.slots.at({a.stage + 1, a.microbatch}).input_grads;
  }
  return slot.output_grads;
}

void Executor::before_accumulating(const Action& a, size_t index) {
  const int64_t local_index = a.stage / schedule_.num_ranks();
  const Stage& stage = stages_[local_index];
  if (!stage.arm_gradient_sync) {
    return;
  }
  // A wrong gradient is worse than an error: nothing may accumulate once the reduction began.
  TORCH_CHECK(!step_.sync_armed[local_index],
              "Pipeline: stage ",
              a.stage,
              " (rank ",
              rank_,
              ") accumulates parameter gradients at ",
              a.to_string(),
              " after its data-parallel reduction started; this schedule cannot be combined with "
              "data parallelism");
  if (index == training_.last_backward[local_index].of(a.kind)) {
    stage.arm_gradient_sync();
    step_.sync_armed[local_index] = true;
  }
}

void Executor::check_gradient_syncs_armed() const {
  const auto mine = schedule_.stages_of_rank(rank_);
  for (size_t i = 0; i < stages_.size(); ++i) {
    TORCH_CHECK(!stages_[i].arm_gradient_sync || step_.sync_armed[i],
                "Pipeline: stage ",
                mine[i],
                " (rank ",
                rank_,
                ") never reached the backward that reduces its data-parallel gradients");
  }
}

void Executor::check_finite(const std::vector<at::Tensor>& tensors,
                            const Action& a,
                            const char* what) const {
  if (check_finite_) {
    require_finite(tensors, a, what, rank_);
  }
}

const Stage& Executor::local(int64_t stage) const { return stages_[stage / schedule_.num_ranks()]; }

}  // namespace torch_mp::pipeline
