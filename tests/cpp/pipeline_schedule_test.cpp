// Pipeline schedules (make_schedule) replayed (simulate) and checked against closed forms: the
// GPipe/1F1B bubble (p - 1) / (m + p - 1), Megatron's interleaved bubble (p - 1) / (v m + p - 1),
// the ZB-H1 bound (p - 1) / (3m + p - 1), the published ZB-V makespan 6m + p - 1. (Their structure:
// pipeline_schedule_structure_test.cpp; the text form, errors and hand-written schedules:
// pipeline_schedule_errors_test.cpp.)
//
// Sizes: p pipeline ranks, m micro-batches, v stages per rank.

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "pipeline_schedule_support.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"

namespace torch_mp::pipeline {
namespace {

// ---- GPipe -----------------------------------------------------------------------------------

class GpipeSimulation : public ::testing::TestWithParam<PipelineSize> {};

TEST_P(GpipeSimulation, BubbleIsPMinusOneOverMPlusPMinusOne) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("gpipe", p, m), forward1_backward2());
  EXPECT_NEAR(result.bubble_fraction, double(p - 1) / double(m + p - 1), kTolerance);
}

TEST_P(GpipeSimulation, MakespanIsMPlusPMinusOneTimesForwardPlusBackward) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("gpipe", p, m), forward1_backward2());
  EXPECT_NEAR(result.makespan, double(m + p - 1) * 3.0, kTolerance);
}

TEST_P(GpipeSimulation, EveryRankHoldsAllMicrobatchesAtItsPeak) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("gpipe", p, m), forward1_backward2());
  ASSERT_EQ(result.peak_live_microbatches.size(), size_t(p));
  for (int64_t r = 0; r < p; ++r) {
    EXPECT_EQ(result.peak_live_microbatches[r], m) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, GpipeSimulation, ::testing::ValuesIn(theory_sizes()), size_name);

// ---- 1F1B ------------------------------------------------------------------------------------

class OneFOneBSimulation : public ::testing::TestWithParam<PipelineSize> {};

TEST_P(OneFOneBSimulation, BubbleIsPMinusOneOverMPlusPMinusOne) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("1f1b", p, m), forward1_backward2());
  EXPECT_NEAR(result.bubble_fraction, double(p - 1) / double(m + p - 1), kTolerance);
}

TEST_P(OneFOneBSimulation, MakespanIsMPlusPMinusOneTimesForwardPlusBackward) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("1f1b", p, m), forward1_backward2());
  EXPECT_NEAR(result.makespan, double(m + p - 1) * 3.0, kTolerance);
}

TEST_P(OneFOneBSimulation, RankRHoldsAtMostPMinusRMicrobatches) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("1f1b", p, m), forward1_backward2());
  ASSERT_EQ(result.peak_live_microbatches.size(), size_t(p));
  for (int64_t r = 0; r < p; ++r) {
    EXPECT_EQ(result.peak_live_microbatches[r], std::min(p - r, m)) << "rank " << r;
    EXPECT_LE(result.peak_live_microbatches[r], p) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, OneFOneBSimulation, ::testing::ValuesIn(theory_sizes()), size_name);

TEST(OneFOneBSimulationWithFewMicrobatches, PeakLiveIsCappedByTheMicrobatchCount) {
  // p = 4, m = 2: the warm-up is cut short by m, so no rank can hold more than m.
  const auto result = simulate(make_schedule("1f1b", 4, 2), forward1_backward2());
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(result.peak_live_microbatches[r], std::min<int64_t>(4 - r, 2)) << "rank " << r;
  }
}

// ---- Interleaved 1F1B ------------------------------------------------------------------------

class InterleavedScheduleSimulation : public ::testing::TestWithParam<PipelineSize> {};

TEST_P(InterleavedScheduleSimulation, BubbleIsMegatronsPMinusOneOverVMPlusPMinusOne) {
  const auto [p, m] = GetParam();
  const int64_t v = 2;
  const auto result =
      simulate(make_schedule("interleaved_1f1b", p * v, m, v), forward1_backward2());
  EXPECT_NEAR(result.bubble_fraction, double(p - 1) / double(v * m + p - 1), kTolerance);
}

TEST_P(InterleavedScheduleSimulation, MakespanIsVMPlusPMinusOneTimesChunkForwardPlusBackward) {
  // Each rank computes v m chunks of F + B = 3 and idles (p - 1) (F + B) in all.
  const auto [p, m] = GetParam();
  const int64_t v = 2;
  const auto result =
      simulate(make_schedule("interleaved_1f1b", p * v, m, v), forward1_backward2());
  EXPECT_NEAR(result.makespan, double(v * m + p - 1) * 3.0, kTolerance);
}

TEST_P(InterleavedScheduleSimulation, ShrinksTheOneFOneBBubbleByTheFormulaRatio) {
  const auto [p, m] = GetParam();
  const int64_t v = 2;
  const double interleaved =
      simulate(make_schedule("interleaved_1f1b", p * v, m, v), forward1_backward2())
          .bubble_fraction;
  const double one_f_one_b =
      simulate(make_schedule("1f1b", p, m), forward1_backward2()).bubble_fraction;
  // (p-1)/(m+p-1) over (p-1)/(vm+p-1); tends to v as m grows, above 1.5 for all sizes here.
  const double expected_ratio = double(v * m + p - 1) / double(m + p - 1);
  ASSERT_GT(interleaved, 0.0);
  EXPECT_NEAR(one_f_one_b / interleaved, expected_ratio, 1e-9);
  EXPECT_GT(one_f_one_b / interleaved, 1.5);
}

INSTANTIATE_TEST_SUITE_P(Sizes,
                         InterleavedScheduleSimulation,
                         ::testing::ValuesIn(theory_sizes()),
                         size_name);

// ---- ZB-H1 -----------------------------------------------------------------------------------

class ZeroBubbleScheduleSimulation : public ::testing::TestWithParam<PipelineSize> {};

TEST_P(ZeroBubbleScheduleSimulation, BubbleIsPMinusOneOverThreeMPlusPMinusOne) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("zb_h1", p, m), unit_split_costs());
  EXPECT_NEAR(result.bubble_fraction, double(p - 1) / double(3 * m + p - 1), kTolerance);
}

TEST_P(ZeroBubbleScheduleSimulation, MakespanIsThreeMPlusPMinusOne) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("zb_h1", p, m), unit_split_costs());
  EXPECT_NEAR(result.makespan, double(3 * m + p - 1), kTolerance);
}

TEST_P(ZeroBubbleScheduleSimulation, BubbleIsBelowOneFOneBWithTheSameCosts) {
  const auto [p, m] = GetParam();
  const auto costs = unit_split_costs();  // 1F1B's BW = backward + weight = 2
  const double zero_bubble = simulate(make_schedule("zb_h1", p, m), costs).bubble_fraction;
  const double one_f_one_b = simulate(make_schedule("1f1b", p, m), costs).bubble_fraction;
  EXPECT_NEAR(one_f_one_b, double(p - 1) / double(m + p - 1), kTolerance);
  EXPECT_LT(zero_bubble, one_f_one_b);
}

TEST_P(ZeroBubbleScheduleSimulation, PeakLiveStaysOneFOneBsAtMostP) {
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("zb_h1", p, m), unit_split_costs());
  for (int64_t r = 0; r < p; ++r) {
    EXPECT_LE(result.peak_live_microbatches[r], p) << "rank " << r;
    EXPECT_EQ(result.peak_live_microbatches[r], std::min(p - r, m)) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes,
                         ZeroBubbleScheduleSimulation,
                         ::testing::ValuesIn(theory_sizes()),
                         size_name);

// ---- ZB-V and interleaved zero-bubble ---------------------------------------------------------

/// p in {2, 4}, m in {2p - 1, 2p, 4p}: ZB-V's pattern needs 2p - 1 micro-batches to fill.
std::vector<PipelineSize> zbv_sizes() {
  std::vector<PipelineSize> sizes;
  for (int64_t p : {2, 4}) {
    for (int64_t m : {2 * p - 1, 2 * p, 4 * p}) {
      sizes.push_back({p, m});
    }
  }
  return sizes;
}

class ZeroBubbleVSimulation : public ::testing::TestWithParam<PipelineSize> {};

TEST_P(ZeroBubbleVSimulation, MakespanIsSixMPlusPMinusOneThePublishedZbv) {
  // Two stages per rank, F = B = W = 1 per stage: 6m of work per rank, and the only wait is the
  // last rank's start-up (p - 1 stage forwards) as in the paper's ZB-V.
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("zbv", 2 * p, m, 2), unit_split_costs());
  EXPECT_NEAR(result.makespan, double(6 * m + p - 1), kTolerance);
}

TEST_P(ZeroBubbleVSimulation, EveryRankHoldsAtMostOneFOneBsPeak) {
  // 2p stage activations = p micro-batches of a rank's (two-stage) layers, 1F1B's rank 0 peak.
  const auto [p, m] = GetParam();
  const auto result = simulate(make_schedule("zbv", 2 * p, m, 2), unit_split_costs());
  for (int64_t r = 0; r < p; ++r) {
    EXPECT_LE(result.peak_live_microbatches[r], 2 * p) << "rank " << r;
  }
  EXPECT_EQ(result.peak_live_microbatches[0], 2 * p);
}

TEST_P(ZeroBubbleVSimulation, IsFasterThanZbH1AndOneFOneBWithTheSameLayers) {
  // The same model: 2p stages on p ranks (ZBV) against p stages of twice the layers (cost 2).
  const auto [p, m] = GetParam();
  CostModel whole_rank;
  whole_rank.forward = whole_rank.backward = 2.0;
  whole_rank.weight = 2.0;
  const double zbv = simulate(make_schedule("zbv", 2 * p, m, 2), unit_split_costs()).makespan;
  EXPECT_LT(zbv, simulate(make_schedule("zb_h1", p, m), whole_rank).makespan);
  EXPECT_LT(zbv, simulate(make_schedule("1f1b", p, m), whole_rank).makespan);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ZeroBubbleVSimulation, ::testing::ValuesIn(zbv_sizes()), size_name);

class InterleavedZeroBubbleSimulation : public ::testing::TestWithParam<PipelineSize> {};

TEST_P(InterleavedZeroBubbleSimulation, MakespanIsThreeVMPlusPMinusOne) {
  const auto [p, m] = GetParam();
  for (int64_t v : {2, 3}) {
    const auto result = simulate(make_schedule("interleaved_zb", p * v, m, v), unit_split_costs());
    EXPECT_NEAR(result.makespan, double(3 * v * m + p - 1), kTolerance) << "v " << v;
  }
}

TEST_P(InterleavedZeroBubbleSimulation, HoldsNoMoreThanInterleavedOneFOneB) {
  const auto [p, m] = GetParam();
  const auto zero_bubble = simulate(make_schedule("interleaved_zb", 2 * p, m, 2));
  const auto interleaved = simulate(make_schedule("interleaved_1f1b", 2 * p, m, 2));
  EXPECT_EQ(zero_bubble.peak_live_microbatches, interleaved.peak_live_microbatches);
}

INSTANTIATE_TEST_SUITE_P(Sizes,
                         InterleavedZeroBubbleSimulation,
                         ::testing::ValuesIn(theory_sizes()),
                         size_name);

}  // namespace
}  // namespace torch_mp::pipeline
