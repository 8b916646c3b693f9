// The step-time estimate (plan/time.h) on hand-sized cases: compute scales with the machine's
// rate, the pipeline's bubble comes from replaying the schedule, data-parallel traffic hides
// behind the backward only up to its last bucket, and a missing link is refused by name. Its
// ranking of real layouts is measured by benchmarks/plan_time.py.

#include <gtest/gtest.h>

#include "tensor_checks.h"
#include "torch_mp/plan/time.h"

namespace torch_mp::plan {
namespace time_test {

using testing::error_of;
using testing::mentions;

const ModelShape kModel{65, 64, 64, 4, 256, 4, 0, std::nullopt};

Layout sized(int64_t pp = 1, int64_t microbatches = 1) {
  Layout l;
  l.pp = pp;
  l.micro_batch = 2;
  l.seq_len = 64;
  l.num_microbatches = microbatches;
  return l;
}

Machine machine() {
  Machine m;
  m.flops = 1e12;
  m.memory_bandwidth = 1e12;
  m.links = {{"tp", 1e11}, {"pp", 1e11}, {"dp", 1e10}};
  m.latency = 1e-6;
  return m;
}

StepTime time_of(const Layout& l, const Machine& m = machine()) {
  return step_time(estimate(kModel, l), l, m);
}

TEST(PlanTime, OneRanksComputeIsItsFlopsAtTheMachinesRate) {
  const Layout l = sized();
  const Estimate e = estimate(kModel, l);
  ASSERT_EQ(e.stages.size(), 1u);
  const StepTime t = time_of(l);
  const Machine m = machine();
  const double compute =
      e.stages[0].forward_flops / m.flops + 2.0 * e.stages[0].saved_bytes / m.memory_bandwidth;
  EXPECT_DOUBLE_EQ(t.forward, compute);
  EXPECT_DOUBLE_EQ(t.backward, 2 * compute);
  EXPECT_DOUBLE_EQ(t.pipeline, 3 * compute);
  EXPECT_DOUBLE_EQ(t.bubble_fraction, 0);
  EXPECT_DOUBLE_EQ(t.data_parallel, 0);
  EXPECT_GT(t.optimizer, 0);
  EXPECT_DOUBLE_EQ(t.seconds, t.pipeline + t.optimizer);
  EXPECT_DOUBLE_EQ(t.tokens_per_second, 2 * 64 / t.seconds);

  Machine faster = machine();
  faster.flops *= 2;
  EXPECT_LT(time_of(l, faster).forward, t.forward);
  Layout full = l;
  full.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(time_of(full).backward, 3 * compute);
}

TEST(PlanTime, ThePipelinesBubbleShrinksWithMoreMicrobatches) {
  const StepTime one = time_of(sized(2, 1));
  const StepTime eight = time_of(sized(2, 8));
  // One micro-batch through two stages: each rank idles half the time (and the message's).
  EXPECT_GT(one.bubble_fraction, 0.49);
  EXPECT_LT(eight.bubble_fraction, one.bubble_fraction / 4);
  EXPECT_GT(eight.pipeline, 4 * one.pipeline);
  EXPECT_GT(eight.communication.at("pp"), one.communication.at("pp"));
}

TEST(PlanTime, DataParallelTrafficOutlastingTheBackwardIsExposed) {
  Layout l = sized();
  l.dp = 2;
  const StepTime slow = time_of(l);
  Machine fast_link = machine();
  fast_link.links["dp"] = 1e14;
  const StepTime fast = time_of(l, fast_link);
  EXPECT_GT(slow.data_parallel, fast.data_parallel);
  EXPECT_GT(fast.data_parallel, 0);  // (the last bucket's reduction waits for the backward)
  EXPECT_GT(slow.communication.at("dp"), 0);
}

TEST(PlanTime, AMissingLinkIsRefusedByName) {
  Layout l = sized();
  l.tp = 2;
  Machine m = machine();
  m.links.erase("tp");
  const auto error = error_of([&] { time_of(l, m); });
  EXPECT_TRUE(mentions(error, "no link for \"tp\" (tp=2)"));
  m = machine();
  m.flops = 0;
  EXPECT_TRUE(mentions(error_of([&] { time_of(sized(), m); }), "flops"));
}

}  // namespace time_test
}  // namespace torch_mp::plan
