// The layouts the estimate takes (plan/estimate.h, check_layout): sizes that divide, settings
// the trainer runs, and what is not estimated yet, each refused by name.

#include "torch_mp/errors.h"
#include "torch_mp/moe/moe.h"
#include "torch_mp/plan/estimate.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::plan {

void check_layout(const ModelShape& model, const Layout& l) {
  const auto positive = [](int64_t value, const char* name) {
    TORCH_MP_CHECK_LAYOUT(value >= 1, "plan.estimate: ", name, " must be at least 1, got ", value);
  };
  positive(l.tp, "tp");
  positive(l.pp, "pp");
  positive(l.dp, "dp");
  positive(l.micro_batch, "micro_batch");
  positive(l.seq_len, "seq_len");
  positive(l.num_microbatches, "num_microbatches");
  positive(l.cp, "cp");
  TORCH_MP_CHECK_LAYOUT(l.cp == 1 || (!model.traced && l.seq_len % (2 * l.cp) == 0),
                        "plan.estimate: context parallelism (cp=",
                        l.cp,
                        ") takes the GPT (torch_mp.models) with seq_len divisible by 2 * cp (the "
                        "load-balanced cuts), got seq_len=",
                        l.seq_len,
                        model.traced ? " and a traced model" : "");
  positive(l.ep, "ep");
  TORCH_MP_CHECK_LAYOUT(
      l.expert_load == 0 || l.expert_load >= 1,
      "plan.estimate: expert_load is the busiest rank's rows over the balanced share (at "
      "least 1; 0 for the default), got ",
      l.expert_load);
  TORCH_MP_CHECK_LAYOUT(l.ep == 1 || model.experts > 0,
                        "plan.estimate: expert parallelism (ep=",
                        l.ep,
                        ") needs MoE layers (GPTConfig.moe_experts)");
  if (model.experts > 0) {
    TORCH_MP_CHECK_LAYOUT(model.top_k >= 1 && model.top_k <= model.experts,
                          "plan.estimate: moe_top_k (",
                          model.top_k,
                          ") must be in [1, moe_experts=",
                          model.experts,
                          "]");
    moe::check_expert_split(model.experts, l.ep);  // (the runtime's check, and its words)
    TORCH_MP_CHECK_LAYOUT((l.dp * l.cp) % l.ep == 0,
                          "plan.estimate: ep=",
                          l.ep,
                          " must divide dp x cp=",
                          l.dp * l.cp,
                          " (the expert groups are cut from the data ranks)");
    // What the GPT's MoE stages (torch_mp.models.GPTStage) refuse, and what is not estimated of
    // a traced mixture of experts.
    TORCH_MP_CHECK_LAYOUT(!l.sequence_parallel && l.cp == 1 && l.recompute == Recompute::kNone,
                          "plan.estimate: MoE layers take no sequence parallelism, no context "
                          "parallelism and no recomputation (got sequence_parallel=",
                          l.sequence_parallel,
                          ", cp=",
                          l.cp,
                          ", recompute ",
                          l.recompute == Recompute::kFull        ? "full"
                          : l.recompute == Recompute::kSelective ? "selective"
                                                                 : "none",
                          ")");
    // What DataParallel and the distributed optimizer refuse: experts in sharded buckets.
    TORCH_MP_CHECK_LAYOUT(
        l.ep == 1 || (l.zero == 0 && l.master_bytes() == 0),
        "plan.estimate: at ep > 1 the experts' parameters are not sharded over the data "
        "ranks: zero must be 0 and no fp32 masters (the bf16 recipe shards the main "
        "gradients); got ep=",
        l.ep,
        ", zero=",
        l.zero);
  }
  TORCH_MP_CHECK_LAYOUT(
      !model.traced || model.layers > 0 ||
          (l.tp == 1 && l.pp == 1 && l.recompute == Recompute::kNone),
      "plan.estimate: a module traced whole (not torch_mp's GPT or a Hugging Face "
      "decoder of torch_mp.plan.DECODERS) is split over data ranks only: tp and pp "
      "must be 1 and recompute None, got tp=",
      l.tp,
      ", pp=",
      l.pp,
      ", recompute ",
      l.recompute == Recompute::kNone ? "None" : "set");
  if (model.traced) {  // (torch_mp.plan checked the config's sizes against tp when tracing)
    TORCH_MP_CHECK_LAYOUT(
        l.recompute != Recompute::kSelective && !l.sequence_parallel,
        "plan.estimate: selective recomputation and sequence parallelism are torch_mp's "
        "GPT layers' (torch_mp.models); a traced model takes recompute None or \"full\"");
  } else {
    TORCH_MP_CHECK_LAYOUT(model.hidden % model.heads == 0,
                          "plan.estimate: hidden (",
                          model.hidden,
                          ") is not divisible by heads (",
                          model.heads,
                          ")");
    // The layers' own checks, in the order a layer makes them (the same words as the runtime's).
    tensor_parallel::divide(model.heads, l.tp, "ParallelSelfAttention: num_heads");
    tensor_parallel::divide(model.ffn, l.tp, "ParallelMLP: ffn_hidden_size");
    TORCH_MP_CHECK_LAYOUT(l.seq_len <= model.positions,
                          "plan.estimate: seq_len=",
                          l.seq_len,
                          " exceeds the model's ",
                          model.positions,
                          " positions");
  }
  TORCH_MP_CHECK_LAYOUT(!l.sequence_parallel || l.seq_len % (l.tp * l.cp) == 0,
                        "plan.estimate: sequence parallelism needs seq_len (",
                        l.seq_len,
                        ") divisible by tp x cp=",
                        l.tp * l.cp);
  TORCH_MP_CHECK_LAYOUT(
      l.zero >= 0 && l.zero <= 3, "plan.estimate: zero must be 0, 1, 2 or 3, got ", l.zero);
  TORCH_MP_CHECK_LAYOUT(
      l.zero < 3 || l.pp == 1,
      "plan.estimate: ZeRO-3 (zero=3) at pp > 1 is not supported (the head's tie to the "
      "embedding sums whole gradients across the pipeline)");
  TORCH_MP_CHECK_LAYOUT(
      c10::isFloatingType(l.dtype) && (l.dtype_bytes() == 2 || l.dtype == c10::kFloat),
      "plan.estimate: dtype must be float32 or a 16-bit floating-point type, got ",
      l.dtype);
  TORCH_MP_CHECK_LAYOUT(
      l.master_bytes() == 0 || l.master_dtype.value_or(c10::kFloat) == c10::kFloat,
      "plan.estimate: master_dtype must be None or float32, got ",
      l.master_dtype.value_or(c10::kFloat));
  TORCH_MP_CHECK_LAYOUT(l.optimizer == "adamw" || l.optimizer == "adam" || l.optimizer == "sgd",
                        "plan.estimate: optimizer must be \"adamw\", \"adam\" or \"sgd\", got \"",
                        l.optimizer,
                        "\"");
}

}  // namespace torch_mp::plan
