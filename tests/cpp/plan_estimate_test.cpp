// The estimate's arithmetic on the C++ side (plan/estimate.h): model states by hand, the
// schedule's micro-batches in flight, rows by rank kind, and refusals naming the setting. Its
// agreement with what the ranks allocate is tested from Python (tests/python/test_plan.py).

#include <gtest/gtest.h>

#include "tensor_checks.h"
#include "torch_mp/errors.h"
#include "torch_mp/plan/estimate.h"

namespace torch_mp::plan {
namespace {

using testing::error_of;
using testing::mentions;

// torch_mp.models' small GPT: 205,504 parameters.
const ModelShape kGpt{65, 64, 64, 4, 256, 4, 0, std::nullopt};
constexpr int64_t kParameters =
    65 * 64 + 64 * 64 + 4 * (3 * 64 * 64 + 64 * 64 + 2 * 64 * 256 + 2 * 64) + 2 * 64;

Layout layout(int64_t dp = 1, int zero = 0) {
  Layout l;
  l.dp = dp;
  l.zero = zero;
  l.micro_batch = 2;
  l.seq_len = 64;
  return l;
}

TEST(PlanEstimate, ModelStatesAreSixteenBytesAParameterAndZeroShardsThem) {
  const RankEstimate plain = estimate(kGpt, layout()).ranks.at(0);
  EXPECT_EQ(plain.kind, "every rank");
  EXPECT_EQ(plain.parameters, 4 * kParameters);
  EXPECT_EQ(plain.gradients, 4 * kParameters);
  EXPECT_EQ(plain.optimizer_state, 8 * kParameters);
  // ZeRO-1 at dp 4: the moments of a quarter (the bucket padded to a multiple of 4).
  const RankEstimate zero1 = estimate(kGpt, layout(4, 1)).ranks.at(0);
  EXPECT_EQ(zero1.optimizer_state, 8 * ((kParameters + 3) / 4));
  // bf16 with fp32 masters: 2-byte parameters, fp32 main gradients (whole buckets), masters.
  Layout bf16 = layout(2, 2);
  bf16.dtype = c10::kBFloat16;  // (master_dtype: float32, the recipe's)
  const RankEstimate mixed = estimate(kGpt, bf16).ranks.at(0);
  EXPECT_EQ(mixed.parameters, 2 * kParameters);
  EXPECT_EQ(mixed.gradients, 4 * kParameters);
  EXPECT_EQ(mixed.optimizer_state, 12 * kParameters / 2);
  EXPECT_EQ(mixed.persistent_buffers, 0);
}

TEST(PlanEstimate, MicrobatchesInFlightComeFromTheSchedule) {
  Layout l = layout();
  l.pp = 4;
  l.num_microbatches = 8;
  std::vector<int64_t> one_f_one_b;
  for (const auto& row : estimate(kGpt, l).ranks) {
    one_f_one_b.push_back(row.microbatches_in_flight);
  }
  EXPECT_EQ(one_f_one_b, (std::vector<int64_t>{4, 3, 2, 1}));
  l.schedule = "gpipe";
  for (const auto& row : estimate(kGpt, l).ranks) {
    EXPECT_EQ(row.microbatches_in_flight, 8) << row.kind;
  }
}

TEST(PlanEstimate, RecomputationAndSequenceParallelismShrinkTheActivations) {
  Layout l = layout();
  l.tp = 2;
  const int64_t none = estimate(kGpt, l).ranks.at(0).activations_per_microbatch;
  l.recompute = Recompute::kSelective;
  const int64_t selective = estimate(kGpt, l).ranks.at(0).activations_per_microbatch;
  l.recompute = Recompute::kFull;
  const int64_t full = estimate(kGpt, l).ranks.at(0).activations_per_microbatch;
  l.recompute = Recompute::kNone;
  l.sequence_parallel = true;
  const int64_t sequence_parallel = estimate(kGpt, l).ranks.at(0).activations_per_microbatch;
  EXPECT_GT(none, selective);
  EXPECT_GT(selective, full);
  EXPECT_GT(none, sequence_parallel);
}

// A traced model (plan::Traced, as torch_mp.plan measures a Hugging Face decoder) of the GPT's
// own shapes holds the same model states, and its measured bytes are what the walk adds up.
TEST(PlanEstimate, ATracedModelIsCountedFromItsShapesAndMeasuredBytes) {
  Traced traced;
  traced.first_parameters = {{65, 64}, {64, 64}};
  traced.layer_parameters = {{192, 64}, {64, 64}, {64}, {64}, {256, 64}, {64, 256}};
  traced.last_parameters = {{64}, {64}};
  traced.tied_head = true;
  traced.layer_activations = 1000;
  traced.layer_input = 100;
  traced.layer_backward = 50;
  traced.first_activations = 10;
  traced.last_activations = 20;
  traced.last_backward = 5000;
  ModelShape model = kGpt;
  model.traced = traced;
  const RankEstimate plain = estimate(kGpt, layout(2, 1)).ranks.at(0);
  const RankEstimate row = estimate(model, layout(2, 1)).ranks.at(0);
  EXPECT_EQ(row.parameters, plain.parameters);
  EXPECT_EQ(row.optimizer_state, plain.optimizer_state);
  EXPECT_EQ(row.activations_per_microbatch, 4 * 1000 + 10 + 20);
  EXPECT_EQ(row.activations, row.activations_per_microbatch + 5000);  // the head's backward
  Layout full = layout();
  full.recompute = Recompute::kFull;
  EXPECT_EQ(estimate(model, full).ranks.at(0).activations_per_microbatch, 4 * 100 + 10 + 20);
  // At pp 2 the tied head is a copy on the last stage.
  Layout split = layout();
  split.pp = 2;
  const auto rows = estimate(model, split).ranks;
  EXPECT_EQ(rows.at(1).parameters - rows.at(0).parameters, 4 * (2 * 64 - 64 * 64));
  full.recompute = Recompute::kSelective;
  EXPECT_TRUE(mentions(error_of([&] { estimate(model, full); }), "recompute None or \"full\""));
}

// A module traced whole (torch_mp.plan.module): no layers, every parameter among the first with
// its ZeRO-3 unit, split over data ranks only.
TEST(PlanEstimate, AModuleTracedWholeIsShardedByItsUnitsAndSplitOverDataRanksOnly) {
  Traced traced;
  traced.first_parameters = {{96, 64}, {256, 64}, {64, 256}, {96, 64}};
  traced.last_activations = 3000;
  traced.last_backward = 700;
  const ModelShape model{96, 0, 1, 1, 0, 0, 0, traced};
  const RankEstimate plain = estimate(model, layout()).ranks.at(0);
  EXPECT_EQ(plain.parameters, 4 * (2 * 96 * 64 + 2 * 256 * 64));
  EXPECT_EQ(plain.activations, 3000 + 700);
  // ZeRO-3 gathers one unit and prefetches the next: two of the largest, whole unit or units.
  const RankEstimate one_unit = estimate(model, layout(2, 3)).ranks.at(0);
  ModelShape units = model;
  units.traced->first_units = {1, 2, 2, 3};
  const RankEstimate three_units = estimate(units, layout(2, 3)).ranks.at(0);
  EXPECT_EQ(one_unit.communication_buffers - one_unit.persistent_buffers,
            2 * 4 * (2 * 96 * 64 + 2 * 256 * 64));
  EXPECT_EQ(three_units.communication_buffers - three_units.persistent_buffers,
            2 * 4 * (2 * 256 * 64));
  for (const char* setting : {"tp", "pp"}) {
    Layout split = layout();
    (setting[0] == 't' ? split.tp : split.pp) = 2;
    EXPECT_TRUE(mentions(error_of([&] { estimate(model, split); }), "split over data ranks only"));
  }
}

TEST(PlanEstimate, ContextRanksHoldTheirShareOfTheTokensAndShardOverDataTimesContext) {
  Layout one = layout(), cp = layout();
  cp.cp = 2;
  cp.zero = 1;
  one.dp = 2;
  one.zero = 1;
  one.seq_len = 32;  // (each context rank's tokens)
  const RankEstimate a = estimate(kGpt, cp).ranks.at(0), b = estimate(kGpt, one).ranks.at(0);
  EXPECT_EQ(a.between_steps(), b.between_steps());  // ZeRO over the 2 data x context ranks
  // the same but for the ring's buffers
  EXPECT_GT(a.peak, b.peak);
  EXPECT_LT(a.peak, b.peak * 1.05);
  EXPECT_GT(estimate(kGpt, cp).bytes_sent.at("cp"), 0);
}

TEST(PlanEstimate, ExpertsAreSplitOverTheExpertGroupAndTheBusiestRankCounted) {
  ModelShape moe = kGpt;
  moe.experts = 4;  // each MLP 4 experts of ffn 256, 2 per token, and a [4, 64] router
  const int64_t experts = 4 * 2 * 4 * 256 * 64;
  const int64_t parameters = kParameters - 4 * 2 * 64 * 256 + experts + 4 * 4 * 64;
  Layout l = layout(4);
  EXPECT_EQ(estimate(moe, l).ranks.at(0).between_steps(), 16 * parameters);
  l.ep = 4;  // a quarter of the experts each; the rest replicated
  const Estimate split = estimate(moe, l);
  EXPECT_EQ(split.ranks.at(0).between_steps(), 16 * (parameters - experts * 3 / 4));
  EXPECT_GT(split.bytes_sent.at("ep"), 0);
  l.expert_load = 1;  // balanced routing: below the default's busiest rank
  EXPECT_LT(estimate(moe, l).ranks.at(0).activations, split.ranks.at(0).activations);
  l.zero = 1;
  EXPECT_TRUE(mentions(error_of([&] { estimate(moe, l); }), "zero must be 0"));
}

TEST(PlanEstimate, ALayoutTheModelCannotTakeIsRefusedByName) {
  Layout l = layout();
  l.tp = 3;
  // The layer's own check, in its words, and typed: what the runtime raises for the same sizes.
  EXPECT_THROW(estimate(kGpt, l), LayoutError);
  EXPECT_TRUE(mentions(error_of([&] { estimate(kGpt, l); }),
                       "ParallelSelfAttention: num_heads (4) must be divisible by the "
                       "tensor-parallel size (3)"));
  l = layout();
  l.ep = 2;
  EXPECT_TRUE(mentions(error_of([&] { estimate(kGpt, l); }), "needs MoE layers"));
  l = layout();
  l.cp = 3;  // (64 tokens do not cut into 6 balanced chunks)
  EXPECT_TRUE(mentions(error_of([&] { estimate(kGpt, l); }), "divisible by 2 * cp"));
  l = layout();
  l.schedule = "looped";
  EXPECT_TRUE(mentions(error_of([&] { estimate(kGpt, l); }), "unknown schedule 'looped'"));
}

}  // namespace
}  // namespace torch_mp::plan
