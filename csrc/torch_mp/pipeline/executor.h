#pragma once
// Runs this rank's part of a pipeline schedule on real stages (DESIGN.md §4, "Execute").

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "torch_mp/pipeline/p2p.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"
#include "torch_mp/pipeline/split_backward.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::pipeline {

/// A stage: its forward (tensors in, tensors out) and the parameters its W computes gradients of.
struct Stage {
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  std::vector<at::Tensor> parameters;
  /// For a data-parallel stage: arms its gradient reduction. The executor calls it once per
  /// step, right before the stage's last backward that accumulates parameter gradients (its
  /// last W, BW, or the B that runs the whole backward), so that the reduction runs once, over
  /// every micro-batch's gradients, overlapped with that backward. `forward` must not arm it
  /// (a DDP module runs its forwards under no_sync).
  std::function<void()> arm_gradient_sync;
};

/// The loss of the last stage's outputs against a micro-batch's targets (a scalar, averaged over
/// the micro-batch).
using LossFn =
    std::function<at::Tensor(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&)>;

/// Walks this rank's action list of a schedule.
///
/// Forward keeps what backward needs; sends are asynchronous and waited for at the end of the
/// step; each micro-batch's loss is divided by the number of micro-batches, so the accumulated
/// parameter gradients equal those of the whole batch's mean loss.
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
  /// fresh group after a timeout or a lost connection, which leave Gloo's pairs closed; the
  /// same one otherwise). Collective over the group: every rank calls it, whether its own step
  /// failed or not. Messages of the failed step are never taken for the next one (the next
  /// step's tags and stamps differ, and each channel starts over with its metadata).
  void reset(GroupPtr group);

  /// What the last step did on this rank, with wall-clock times (seconds from its start).
  const std::vector<TimedAction>& trace() const { return trace_; }
  const Schedule& schedule() const { return schedule_; }
  /// This rank in the pipeline group.
  int64_t rank() const { return rank_; }
  /// The pipeline group.
  const GroupPtr& group() const { return group_; }
  /// This Pipeline's id, the same on every rank of its group and different for every Pipeline
  /// (and reset) the group has run.
  int64_t id() const { return pipeline_id_; }

 private:
  // What one (stage, micro-batch) holds between its actions.
  struct Slot {
    std::vector<at::Tensor> inputs;        // stage inputs (leaves that require grad, in training)
    std::vector<at::Tensor> outputs;       // stage outputs; {loss / m} on the last stage
    std::vector<at::Tensor> output_grads;  // gradients of the outputs, from the next stage
    std::vector<at::Tensor> input_grads;   // gradients of the inputs, for the previous stage
    WeightWork weight_work;                // what B kept for W
    bool weight_pending = false;           // B was split: W still has to run
    // Last stage: the loss / m, computed from detached copies of the outputs (loss_inputs), so
    // that backward through the loss runs once, before B, and never again at W (a loss such as
    // vocab_parallel_cross_entropy turns its saved buffers into the gradient in place).
    at::Tensor loss;
    std::vector<at::Tensor> loss_inputs;
  };
  // Runs `actions`; collects the last stage's per-micro-batch outputs into `outputs` if given.
  std::optional<at::Tensor> run(const std::vector<Action>& actions,
                                const std::vector<std::vector<at::Tensor>>& inputs,
                                const std::vector<std::vector<at::Tensor>>& targets,
                                bool train,
                                std::vector<std::vector<at::Tensor>>* outputs);
  void forward(const Action& a,
               Slot& slot,
               const std::vector<std::vector<at::Tensor>>& inputs,
               const std::vector<std::vector<at::Tensor>>& targets,
               bool train,
               std::vector<std::vector<at::Tensor>>* outputs);
  void backward(const Action& a, size_t index, Slot& slot);
  void weight(const Action& a, size_t index, Slot& slot);
  void before_accumulating(const Action& a, size_t index);
  void require_finite(const std::vector<at::Tensor>& tensors,
                      const Action& a,
                      const char* what) const;
  std::vector<at::Tensor> gradients_for(const Action& a, Slot& slot);
  // The message an action sends or receives, numbered alike on both ends (its channel), and
  // the first of its tags in the running step.
  int64_t message_of(const Action& a) const;
  int tag(int64_t message) const;
  // Posts the receive at `index` of `actions`.
  void post(const std::vector<Action>& actions, size_t index);
  std::string where(const Action& a) const;
  // Drops the step's slots, keeping its in-flight sends and receives alive in orphans_ (a
  // failed step, reset): Gloo may still touch their buffers.
  void abandon_in_flight();
  // Agrees on pipeline_id_ over the group (the constructor and reset).
  void agree_on_id();
  // Raises, on every rank, if another rank's step failed: one all-reduce of where failures
  // began, then (only after a failure) the first one's text, broadcast from its rank.
  void agree(const std::optional<PeerFailure>& failure);
  // After a failure at `index` of `actions`: sends a failure marker in place of every message
  // this rank still owed (so that its peers raise at once), agrees with the others unless the
  // group is broken, and raises.
  [[noreturn]] void fail(const std::vector<Action>& actions, size_t index, const PeerFailure& e);
  // The failure an exception at `index` of `actions` means, named by rank, stage, micro-batch
  // and action (and by the peer, for communication errors).
  PeerFailure failure_of(const std::vector<Action>& actions,
                         size_t index,
                         const std::exception& e) const;
  Stage& local(int64_t stage);

  Schedule schedule_;
  std::vector<Stage> stages_;
  LossFn loss_;
  GroupPtr group_;
  int64_t rank_;
  // Messages are bound to their Pipeline and step (p2p.h's MessageStamp and the tags), so a
  // message left over from a failed step is never taken for a new one.
  int64_t pipeline_id_ = 0;
  int64_t steps_run_ = 0;
  at::Device device_ = at::kCPU;
  std::map<std::pair<int64_t, int64_t>, Slot> slots_;
  // For the forward-only [0] and the training [1] action lists: after which receive (by index)
  // which sends are known to be complete, so that their buffers go then.
  std::map<size_t, std::vector<size_t>> released_by_[2];
  // Sends in flight, with the index of their action.
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, size_t>> pending_sends_;
  // This step's receives posted ahead, by index in the action list: kRecvsAhead at a time, the
  // next one posted as one is finished (so that data can arrive while the rank computes,
  // without allocating every receive of the step at its start).
  static constexpr size_t kRecvsAhead = 2;
  std::map<size_t, PendingRecv> posted_recvs_;
  size_t next_recv_ = 0;  // index in the action list of the next receive to post
  // What each end last passed through each message's channel (p2p.h), by message_of.
  std::map<int64_t, Channel> send_channels_;
  std::map<int64_t, Channel> recv_channels_;
  std::vector<at::Tensor> losses_;
  std::vector<TimedAction> trace_;
  // Per local stage: the index in this rank's action list of its last BW, B and W, and whether
  // its gradient sync was armed in the running step.
  struct LastBackward {
    size_t full = SIZE_MAX, input = SIZE_MAX, weight = SIZE_MAX;
  };
  std::vector<LastBackward> last_backward_;
  std::vector<bool> sync_armed_;
  bool check_finite_ = false;
  bool broken_ = false;  // a step failed (here or on another rank): reset() before the next
  // Failure markers still in flight, and groups replaced by reset() with the works that were
  // pending on them: kept alive so that no buffer is freed under Gloo's threads.
  std::vector<c10::intrusive_ptr<c10d::Work>> orphans_;
  std::vector<GroupPtr> old_groups_;
};

/// Splits each tensor of `batch` along dim 0 into `num_microbatches` equal micro-batches:
/// result[m] holds micro-batch m of every tensor. Raises if a batch size is not divisible.
std::vector<std::vector<at::Tensor>> split_microbatches(const std::vector<at::Tensor>& batch,
                                                        int64_t num_microbatches);

}  // namespace torch_mp::pipeline
