#pragma once
// What a layout costs each rank before it is launched: bytes of parameters, gradients, optimizer
// state, activations and communication buffers, the peak, and the work and traffic of a step
// (docs/plan.md). Counted from the model's shapes by the rules the layers, DataParallel, the
// distributed optimizer and the pipeline executor follow: the ZeRO buckets are
// data_parallel::ShardLayout's own, and the micro-batches in flight come from walking the
// schedule's action list (pipeline::make_schedule), not from a formula.
//
// The model is the GPT of torch_mp.models (pre-LN layers without biases, learned positions, a
// head tied to the token embedding; with moe_experts, a mixture of experts for each MLP, its
// experts over the expert group), trained with AdamW by torch_mp.models.Trainer3D, or a model
// traced by torch_mp.plan (a Hugging Face decoder: its shapes and saved bytes measured on fake
// tensors at the layout's sizes, ModelShape::traced; or any module traced whole, its layers
// not told apart, split over data ranks only).

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torch_mp::plan {

/// A decoder measured on one tensor rank (torch_mp.plan traces it on fake tensors) at the
/// layout's micro-batch, sequence length, dtype and tensor-parallel size, or a module traced whole
/// (no layers: every parameter among the first, its bytes the last's): its parameters' shapes and
/// the bytes its forward saves for the backward, where no formula of the GPT's applies.
struct Traced {
  std::vector<std::vector<int64_t>> layer_parameters;  ///< one decoder layer's
  std::vector<std::vector<int64_t>> first_parameters;  ///< the token embedding (and positions)
  std::vector<std::vector<int64_t>> last_parameters;   ///< the final norm and an untied head
  /// ZeRO-3's unit of each first parameter (empty: 0, the model's own). A module traced whole
  /// (no layers) holds every parameter among the first, each in its DataParallel unit.
  std::vector<int64_t> first_units;
  bool tied_head = false;         ///< the head is the token embedding (a copy at pp > 1)
  int64_t layer_activations = 0;  ///< saved by one layer per micro-batch
  int64_t layer_input = 0;        ///< one layer's input (what full recomputation keeps)
  int64_t layer_backward = 0;     ///< the most one layer's backward holds beyond its saved
  int64_t first_activations = 0;  ///< saved by the embedding
  int64_t last_activations = 0;   ///< saved by the final norm, the head and the loss
  int64_t last_backward = 0;      ///< the most the head's and loss's backward hold beyond
  double layer_flops = 0;         ///< one layer's forward
  double last_flops = 0;          ///< the head's and the loss's forward
  int64_t layer_operators = 0;    ///< operators one layer's forward dispatches
  int64_t last_operators = 0;     ///< the embedding's, the head's and the loss's
};

/// The model's sizes (torch_mp.models.GPTConfig's).
struct ModelShape {
  int64_t vocab = 0;
  int64_t positions = 0;  ///< rows of the learned position table
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t ffn = 0;
  int64_t layers = 0;
  int64_t experts = 0;           ///< MoE experts per layer (0: dense MLPs)
  std::optional<Traced> traced;  ///< set: a traced decoder or module (positions and ffn unused)
  int64_t top_k = 2;             ///< the experts each token is routed to
};

enum class Recompute : uint8_t { kNone, kSelective, kFull };

/// Operators one micro-batch's forward dispatches through one part of torch_mp.models' GPT as
/// Trainer3D runs it (a GPTStage), counted at the dispatcher (PeakMemory's count): alone (tp 1),
/// and what is added at tp > 1 (the collectives, the vocabulary's masks), beyond that under
/// sequence parallelism, in a stage of MoE layers, and at ep > 1 (the all-to-alls). Each costs
/// Machine::op_overhead in the step time. tests/python/test_plan_layout.py runs the parts and
/// holds this table to what they dispatch, so a layer that changes fails that test.
struct OperatorCount {
  int64_t alone = 0, tensor_parallel = 0, sequence_parallel = 0, moe = 0, expert_parallel = 0;

  int64_t at(bool tp, bool sp, bool moe_stage, bool ep) const {
    return alone + (tp ? tensor_parallel : 0) + (tp && sp ? sequence_parallel : 0) +
           (moe_stage ? moe : 0) + (ep ? expert_parallel : 0);
  }
};

/// The GPT's parts (kGptOperators).
struct GptOperators {
  OperatorCount layer{32, 4, 2};             ///< a ParallelTransformerLayer
  OperatorCount moe_layer{65, 2, 0, 0, 32};  ///< a ParallelMoELayer
  OperatorCount embeddings{7, 5, 1, 1};      ///< the first stage's, before its layers
  OperatorCount head_and_loss{16, 1, 2, 2};  ///< the last stage's norm, tied head and loss
};
inline constexpr GptOperators kGptOperators{};

/// How the model is laid out and trained.
struct Layout {
  int64_t tp = 1, pp = 1, dp = 1, cp = 1, ep = 1;
  int zero = 0;  ///< 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp
  Recompute recompute = Recompute::kNone;
  bool sequence_parallel = false;
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< the parameters' and the compute's
  /// The optimizer's masters (and main gradients) of a 16-bit model. nullopt: float32 for a
  /// 16-bit dtype (the recipe, which implies zero >= 2), none for float32; equal to dtype: none.
  std::optional<c10::ScalarType> master_dtype;
  int64_t micro_batch = 1;
  int64_t seq_len = 0;
  int64_t num_microbatches = 1;
  std::string schedule = "1f1b";
  std::string optimizer = "adamw";  ///< "adamw" or "adam" (two moments), "sgd" (none)
  double bucket_cap_mb = 25.0;
  /// MoE layers at ep > 1: the rows the busiest rank's experts receive over their balanced share
  /// (n * top_k). 0: what routing at random gives the busiest of ep ranks, 1 + sqrt(2 ln ep) *
  /// sqrt((ep - 1) / (ep * n * top_k)) (the expected largest of ep normal variables is at most
  /// sqrt(2 ln ep) standard deviations above their mean).
  double expert_load = 0;

  /// Bytes of an element of dtype.
  int64_t dtype_bytes() const { return static_cast<int64_t>(c10::elementSize(dtype)); }
  /// Bytes of an element of the masters (master_dtype resolved); 0 when there are none.
  int64_t master_bytes() const {
    const bool sixteen = c10::elementSize(dtype) < 4;
    const auto masters = master_dtype.value_or(sixteen ? c10::ScalarType::Float : dtype);
    return masters == dtype ? 0 : static_cast<int64_t>(c10::elementSize(masters));
  }
};

/// One kind of rank (the ranks of one pipeline position; tensor and data ranks alike).
struct RankEstimate {
  std::string kind;                     ///< "every rank", "first stage", "last stage", ...
  std::vector<int64_t> pipeline_ranks;  ///< the pipeline ranks it describes
  int64_t parameters = 0;
  int64_t gradients = 0;        ///< .grad, flat gradient buffers, ZeRO shards, fp32 main gradients
  int64_t optimizer_state = 0;  ///< moments and fp32 masters
  /// Kept between steps: ZeRO-2/3's reduce-scatter staging. At the peak also: ZeRO-3's gathered
  /// units and the pipeline's send and receive buffers.
  int64_t communication_buffers = 0;
  int64_t persistent_buffers = 0;          ///< the part of communication_buffers kept between steps
  int64_t activations_per_microbatch = 0;  ///< saved for the backward, all of the rank's stages
  int64_t microbatches_in_flight = 0;      ///< the most whose activations are held at once
  int64_t activations = 0;                 ///< held at the peak, the backward's own included
  /// .grad accumulating over the micro-batches at the peak (before DataParallel takes it)
  int64_t accumulating_gradients = 0;
  /// between_steps() + activations + accumulating_gradients + the buffers of the peak
  int64_t peak = 0;

  /// What stays from one step to the next: parameters, gradients, optimizer state and the
  /// persistent buffers.
  int64_t between_steps() const {
    return parameters + gradients + optimizer_state + persistent_buffers;
  }
};

/// One pipeline stage's work for one micro-batch (on one tensor rank), what the step-time
/// estimate (plan/time.h) is built from.
struct StageWork {
  double forward_flops = 0;  ///< its forward's floating-point operations
  int64_t operators = 0;     ///< operators its forward dispatches (the backward about twice)
  /// Of forward_flops, the attention core's (what selective recomputation repeats).
  double attention_flops = 0;
  /// Bytes its forward saves for the backward without recomputation: the elementwise traffic
  /// that bounds the non-matmul part of its time.
  int64_t saved_bytes = 0;
  double tp_bytes = 0;      ///< sent over the tensor group by its forward (as much by the backward)
  int64_t tp_messages = 0;  ///< tensor-group collectives of its forward (as many in the backward)
  double cp_bytes = 0;      ///< sent around the context ring by its forward (twice as much back)
  int64_t cp_messages = 0;  ///< the ring's steps in its forward (as many in the backward)
  double ep_bytes = 0;      ///< sent over the expert group by its forward (as much by the backward)
  int64_t ep_messages = 0;  ///< all-to-alls of its forward (as many in the backward)
};

/// A layout's estimate.
struct Estimate {
  std::vector<RankEstimate> ranks;
  /// Floating-point operations of one step on one rank (forward, backward and recomputation).
  double flops_per_rank = 0;
  /// Bytes each rank sends per step, by dimension ("tp", "pp", "dp", "cp", "ep"; "dp" over the
  /// data x context group, the experts' gradients over the ranks holding the same experts).
  std::map<std::string, double> bytes_sent;
  /// Of bytes_sent["dp"], what gathers the parameters (ZeRO-1/2 after the step, ZeRO-3 in the
  /// forward and the backward); the rest reduces the gradients.
  double dp_gathered_bytes = 0;
  /// Per stage (in schedule order, pp * stages per rank of them), one micro-batch's work.
  std::vector<StageWork> stages;
  /// One activation (or its gradient) sent between two stages.
  double pp_message_bytes = 0;

  /// A table, one row per rank kind.
  std::string to_string() const;
};

/// Raises, naming the setting, if `layout` cannot take `model` (sizes not divisible, a sequence
/// past the positions, what the trainer cannot run: MoE layers with sequence or context
/// parallelism or recomputation, experts sharded by ZeRO at ep > 1) or is not estimated yet (a
/// traced model's context parallelism; a module traced whole at tp, pp > 1 or with
/// recomputation). `estimate` calls it first.
void check_layout(const ModelShape& model, const Layout& layout);

/// Estimates `layout` of `model`. Raises, naming the setting, on a layout the model cannot take
/// (sizes not divisible, an unknown schedule or optimizer) or one not estimated yet
/// (check_layout). MoE layers are counted at the busiest rank's load (Layout::expert_load).
Estimate estimate(const ModelShape& model, const Layout& layout);

}  // namespace torch_mp::plan
