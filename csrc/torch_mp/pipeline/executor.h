#pragma once
// Runs this rank's part of a pipeline schedule on real stages (docs/design.md §4.4, "Execute").
//
// The executor is an interpreter of the rank's action list (action_plan.h): each action goes to
// one handler, which computes on a stage (stage.h) or passes a message (mailbox.h). A failure on
// any rank reaches every rank by the failure protocol (failure.h).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_mp/pipeline/action_plan.h"
#include "torch_mp/pipeline/failure.h"
#include "torch_mp/pipeline/mailbox.h"
#include "torch_mp/pipeline/microbatches.h"
#include "torch_mp/pipeline/p2p.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"
#include "torch_mp/pipeline/stage.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/split_backward.h"

namespace torch_mp::pipeline {

/// Walks this rank's action list of a schedule.
///
/// Forward keeps what backward needs; sends are asynchronous and waited for at the end of the
/// step; each micro-batch's loss is divided by the number of micro-batches, so the accumulated
/// parameter gradients equal those of the whole batch's mean loss.
///
/// Under NCCL's rules (an NCCL group, or any group with TORCH_MP_CHECK_COLLECTIVES=1, so that a
/// Gloo run shows what NCCL would do), the schedule is first made NCCL-safe (make_nccl_safe) and
/// proved to run under CommSemantics::kNccl, and each group of consecutive sends and receives
/// (p2p_groups) is posted together (comm::P2PGroup) when the first of them is reached, under one
/// tag per pair of ranks, instead of receives posted ahead and tags per message.
///
/// Split backward (split_backward.h): B computes the input gradients only, keeping the
/// gradients that arrive at the nodes which also feed parameters; W restarts from those towards
/// the parameters, so B + W do the work of one backward. On the first stage, which has no input
/// gradient to produce, B runs the whole backward and W is empty. On the last stage
/// the loss is cut from the stage's graph: its backward runs once, at the start of B, and both B
/// and W start from the gradient of the stage's outputs. The batch given to the first stage
/// receives no gradient.
class Executor {
 public:
  /// `stages` are this rank's stages in increasing stage order (Schedule::stages_of_rank).
  /// Checks that `schedule` runs (simulate), fits `group` and `stages`, and is the same on every
  /// rank of `group`; raises otherwise.
  Executor(Schedule schedule, std::vector<Stage> stages, LossFn loss, GroupPtr group);

  /// One training step. `inputs[m]` are micro-batch m's inputs to stage 0 and `targets[m]` its
  /// targets, each on the rank holding that stage (empty elsewhere). Returns the mean of the
  /// micro-batch losses on the rank holding the last stage, nullopt elsewhere.
  std::optional<at::Tensor> step(const std::vector<std::vector<at::Tensor>>& inputs,
                                 const std::vector<std::vector<at::Tensor>>& targets);

  /// Forward only, without autograd. Returns, on the last stage's rank, the micro-batches' outputs
  /// concatenated along dim 0, and their mean loss if `targets` were given.
  std::pair<std::vector<at::Tensor>, std::optional<at::Tensor>> eval_step(
      const std::vector<std::vector<at::Tensor>>& inputs,
      const std::vector<std::vector<at::Tensor>>& targets);

  /// With `on`, every stage output, loss and input gradient is checked for NaN and Inf as it is
  /// made, and the first one found raises, naming the stage, micro-batch, action and tensor
  /// (off by default: one reduction per tensor).
  void set_check_finite(bool on) { check_finite_ = on; }

  /// Makes the executor usable again after a step that failed (on any rank), over `group` (a
  /// fresh group after a timeout or a lost connection, which leave Gloo's pairs closed, and
  /// always under NCCL's rules, which match messages by order alone; the same one otherwise).
  /// Collective over the group: every rank calls it, whether its own step failed or not. Messages
  /// of the failed step are never taken for the next one (the next step's tags and stamps differ,
  /// and each channel starts over with its metadata).
  void reset(GroupPtr group);

  /// What the last step did on this rank, with wall-clock times (seconds from its start).
  const std::vector<TimedAction>& trace() const { return step_.trace; }
  /// The schedule this executor runs.
  const Schedule& schedule() const { return schedule_; }
  /// This rank in the pipeline group.
  int64_t rank() const { return rank_; }
  /// The pipeline group.
  const GroupPtr& group() const { return mailbox_.group; }
  /// This Pipeline's id, the same on every rank of its group and different for every Pipeline
  /// (and reset) the group has run.
  int64_t id() const { return mailbox_.stamp.pipeline; }
  /// Whether it runs under NCCL's rules (see the class comment).
  bool ordered() const { return mailbox_.ordered; }

 private:
  // What step() or eval_step() was given, and where eval_step collects the last stage's
  // per-micro-batch outputs (null: nowhere).
  struct StepArguments {
    const std::vector<std::vector<at::Tensor>>& inputs;
    const std::vector<std::vector<at::Tensor>>& targets;
    bool train;
    std::vector<std::vector<at::Tensor>>* outputs;
  };
  // What the running step holds; begin_step starts it afresh.
  struct StepState {
    std::map<std::pair<int64_t, int64_t>, Slot> slots;  // by (stage, micro-batch)
    // Sends in flight, with the index of their action.
    std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, size_t>> pending_sends;
    // Receives posted ahead, by index in the action list: kRecvsAhead at a time, the next one
    // posted as one is finished (so that data can arrive while the rank computes, without
    // allocating every receive of the step at its start).
    std::map<size_t, PendingRecv> posted_recvs;
    size_t next_recv = 0;     // in ActionPlan::receives: the next receive to post
    size_t posted_until = 0;  // NCCL's rules: the actions before it are posted
    // NCCL: the buffers of the groups posted, kept until the step's sends are waited for.
    std::vector<at::Tensor> posted_buffers;
    std::vector<at::Tensor> losses;
    std::vector<bool> sync_armed;  // per local stage: its gradient sync was armed
    std::vector<TimedAction> trace;
  };
  static constexpr size_t kRecvsAhead = 2;

  // The run loop: the actions of `plan`, one handler each (execute), then the closing checks
  // and the agreement of every rank on the step.
  std::optional<at::Tensor> run(const ActionPlan& plan, const StepArguments& args);
  void begin_step();
  void execute(const ActionPlan& plan, size_t index, const StepArguments& args);
  std::optional<at::Tensor> end_step();

  // One handler per kind of action.
  void receive(const ActionPlan& plan, size_t index, Slot& slot, bool train);
  void send(const ActionPlan& plan, size_t index, Slot& slot);
  void forward(const Action& a, Slot& slot, const StepArguments& args);
  void backward(const Action& a, size_t index, Slot& slot);
  void weight(const Action& a, size_t index, Slot& slot);

  // What the handlers share.
  void post_next_recv(const ActionPlan& plan);
  // NCCL's rules: posts the group of sends and receives that starts at `index`, if one does.
  void post_group(const ActionPlan& plan, size_t index);
  void post_send(const ActionPlan& plan, size_t index, Slot& slot);
  // Waits for (and drops) the sends that the receive at `index` shows complete.
  void release_sends(const ActionPlan& plan, size_t index);
  void take_inputs(const Action& a, Slot& slot, const StepArguments& args);
  void take_loss(const Action& a,
                 Slot& slot,
                 std::vector<at::Tensor> outputs,
                 const StepArguments& args);
  std::vector<at::Tensor> gradients_for(const Action& a, Slot& slot);
  // Arms the stage's gradient sync right before its last backward that accumulates.
  void before_accumulating(const Action& a, size_t index);
  void check_gradient_syncs_armed() const;
  // require_finite, if set_check_finite(true).
  void check_finite(const std::vector<at::Tensor>& tensors,
                    const Action& a,
                    const char* what) const;
  // Raises on every rank unless the pipeline is the same on every rank; then unless the
  // schedule fits the group and the stages.
  void check_fits() const;
  const Stage& local(int64_t stage) const;

  // The failure protocol (failure.h; fail, abandon_in_flight and reset are in failure.cpp)
  // after a failure at `index` of `plan`: failure markers in place of every message this rank
  // still owed, the agreement unless the group is broken, and the error.
  [[noreturn]] void fail(const ActionPlan& plan, size_t index, const PeerFailure& failure);
  // Drops the step's slots, keeping its in-flight sends and receives alive in orphans_ (a
  // failed step, reset): Gloo may still touch their buffers.
  void abandon_in_flight();

  // What the executor runs (fixed at construction), and whether it checks for NaN and Inf.
  Schedule schedule_;
  std::vector<Stage> stages_;
  LossFn loss_;
  int64_t rank_ = 0;
  bool check_finite_ = false;
  // This rank's training (every action) and evaluation (forward only) action lists, analysed.
  ActionPlan training_;
  ActionPlan evaluation_;
  Mailbox mailbox_;
  StepState step_;
  bool broken_ = false;  // a step failed (here or on another rank): reset() before the next
  Orphans orphans_;
};

}  // namespace torch_mp::pipeline
