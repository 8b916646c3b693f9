// Pipeline schedules (make_schedule, the text form) and their replay (simulate), checked against
// closed forms: the GPipe/1F1B bubble (p - 1) / (m + p - 1), Megatron's interleaved bubble
// (p - 1) / (v m + p - 1), the ZB-H1 bound (p - 1) / (3m + p - 1), the published ZB-V makespan
// 6m + p - 1, and hand-computed makespans.
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

#include "tensor_checks.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"

namespace torch_mp::pipeline {
namespace {

using testing::error_of;
using testing::mentions;

constexpr double kTolerance = 1e-12;

/// The costs the 1F1B papers use: a backward twice a forward, comm free.
CostModel forward1_backward2() {
  CostModel costs;
  costs.forward = 1.0;
  costs.backward = 2.0;
  return costs;
}

/// F = B = W = 1 (so BW = 2), the ZB-H1 paper's setting.
CostModel unit_split_costs() {
  CostModel costs;
  costs.forward = 1.0;
  costs.backward = 1.0;
  costs.weight = 1.0;
  return costs;
}

/// Per-rank action lists from text, e.g. {{"F(0,0)", "SEND_F(0,0)"}, {"RECV_F(1,0)", ...}}.
Schedule hand_schedule(int64_t num_stages,
                       int64_t num_microbatches,
                       const std::vector<std::vector<std::string>>& ranks) {
  Schedule schedule;
  schedule.name = "hand";
  schedule.num_stages = num_stages;
  schedule.num_microbatches = num_microbatches;
  schedule.stages_per_rank = num_stages / static_cast<int64_t>(ranks.size());
  for (const auto& texts : ranks) {
    std::vector<Action> actions;
    for (const auto& text : texts) {
      actions.push_back(Action::parse(text));
    }
    schedule.actions.push_back(actions);
  }
  return schedule;
}

/// Removes the first occurrence of `text` from rank `rank`'s list (fails the test if absent).
void remove_action(Schedule& schedule, int64_t rank, const std::string& text) {
  auto& actions = schedule.actions[rank];
  const auto it = std::find(actions.begin(), actions.end(), Action::parse(text));
  ASSERT_NE(it, actions.end()) << text << " is not on rank " << rank;
  actions.erase(it);
}

/// Index of `text` in rank `rank`'s list, or -1.
int64_t position_of(const Schedule& schedule, int64_t rank, const std::string& text) {
  const auto& actions = schedule.actions[rank];
  const auto it = std::find(actions.begin(), actions.end(), Action::parse(text));
  return it == actions.end() ? -1 : it - actions.begin();
}

// ---- Sizes the tests sweep -------------------------------------------------------------------

/// p ranks and m micro-batches for one-stage-per-rank schedules.
struct PipelineSize {
  int64_t p;
  int64_t m;
};

void PrintTo(const PipelineSize& s, std::ostream* os) { *os << "p " << s.p << ", m " << s.m; }

std::string size_name(const ::testing::TestParamInfo<PipelineSize>& info) {
  return "p" + std::to_string(info.param.p) + "_m" + std::to_string(info.param.m);
}

/// p in {2, 4}, m in {p, 2p, 4p}.
std::vector<PipelineSize> theory_sizes() {
  std::vector<PipelineSize> sizes;
  for (int64_t p : {2, 4}) {
    for (int64_t m : {p, 2 * p, 4 * p}) {
      sizes.push_back({p, m});
    }
  }
  return sizes;
}

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

// ---- Structure of every generated schedule ---------------------------------------------------

/// A generator call: name, p ranks, m micro-batches, v stages per rank.
struct ScheduleCase {
  std::string name;
  int64_t p;
  int64_t m;
  int64_t v;
};

void PrintTo(const ScheduleCase& c, std::ostream* os) {
  *os << c.name << ", p " << c.p << ", m " << c.m << ", v " << c.v;
}

std::string schedule_case_name(const ::testing::TestParamInfo<ScheduleCase>& info) {
  return info.param.name + "_p" + std::to_string(info.param.p) + "_m" +
         std::to_string(info.param.m) + "_v" + std::to_string(info.param.v);
}

/// Every generator at sizes from one rank up, with fewer, as many and more micro-batches than
/// ranks (interleaved: multiples of p only; zbv: also fewer than its 2p - 1 warm-up).
std::vector<ScheduleCase> all_schedule_cases() {
  std::vector<ScheduleCase> cases;
  for (int64_t p : {1, 2, 3, 4}) {
    for (int64_t m : std::set<int64_t>{1, 2, p, 2 * p + 1, 4 * p}) {  // a set drops repeats
      for (const char* name : {"gpipe", "1f1b", "zb_h1"}) {
        cases.push_back({name, p, m, 1});
      }
    }
    for (int64_t v : {2, 3}) {
      for (int64_t m : {p, 2 * p, 3 * p}) {
        cases.push_back({"interleaved_1f1b", p, m, v});
        cases.push_back({"interleaved_zb", p, m, v});
      }
    }
    for (int64_t m : std::set<int64_t>{1, 2, p, 2 * p - 1, 2 * p + 1, 4 * p}) {
      cases.push_back({"zbv", p, m, 2});
    }
  }
  return cases;
}

class ScheduleStructure : public ::testing::TestWithParam<ScheduleCase> {
 protected:
  Schedule generate() const {
    const auto& c = GetParam();
    return make_schedule(c.name, c.p * c.v, c.m, c.v);
  }
  /// How often each (kind, stage, micro-batch) occurs, over all ranks.
  static std::map<std::tuple<ActionKind, int64_t, int64_t>, int> counts(const Schedule& s) {
    std::map<std::tuple<ActionKind, int64_t, int64_t>, int> out;
    for (const auto& actions : s.actions) {
      for (const Action& a : actions) ++out[{a.kind, a.stage, a.microbatch}];
    }
    return out;
  }
};

TEST_P(ScheduleStructure, RecordsTheSizesItWasMadeFor) {
  const auto& c = GetParam();
  const Schedule s = generate();
  EXPECT_EQ(s.name, c.name);
  EXPECT_EQ(s.num_stages, c.p * c.v);
  EXPECT_EQ(s.num_microbatches, c.m);
  EXPECT_EQ(s.stages_per_rank, c.v);
  EXPECT_EQ(s.num_ranks(), c.p);
}

TEST_P(ScheduleStructure, EveryStageAndMicrobatchHasOneForwardAndOneBackward) {
  const auto& c = GetParam();
  const Schedule s = generate();
  auto n = counts(s);
  int64_t compute_actions = 0;
  for (const auto& [key, count] : n) {
    if (is_compute(std::get<0>(key))) compute_actions += count;
  }
  int64_t expected_compute_actions = 0;
  for (int64_t stage = 0; stage < c.p * c.v; ++stage) {
    for (int64_t mb = 0; mb < c.m; ++mb) {
      const int f = n[{ActionKind::kForward, stage, mb}];
      const int bw = n[{ActionKind::kFullBackward, stage, mb}];
      const int b = n[{ActionKind::kBackwardInput, stage, mb}];
      const int w = n[{ActionKind::kBackwardWeight, stage, mb}];
      EXPECT_EQ(f, 1) << "F(" << stage << "," << mb << ")";
      EXPECT_TRUE((bw == 1 && b == 0 && w == 0) || (bw == 0 && b == 1 && w == 1))
          << "stage " << stage << " micro-batch " << mb << ": BW x" << bw << ", B x" << b << ", W x"
          << w;
      expected_compute_actions += 1 + (bw == 1 ? 1 : 2);
    }
  }
  // Nothing else computes (no stage or micro-batch out of range).
  EXPECT_EQ(compute_actions, expected_compute_actions);
}

TEST_P(ScheduleStructure, EveryActionSitsOnTheRankOfItsStage) {
  const Schedule s = generate();
  for (int64_t r = 0; r < s.num_ranks(); ++r) {
    for (const Action& a : s.actions[r]) {
      EXPECT_EQ(s.rank_of_stage(a.stage), r) << a.to_string() << " on rank " << r;
    }
  }
}

TEST_P(ScheduleStructure, EverySendHasItsReceiveOnTheNeighboursRank) {
  const auto& c = GetParam();
  const Schedule s = generate();
  auto n = counts(s);
  for (int64_t r = 0; r < s.num_ranks(); ++r) {
    for (const Action& a : s.actions[r]) {
      if (a.kind == ActionKind::kSendForward) {
        // SEND_F(s,m) feeds RECV_F(s+1,m), which lives on another rank.
        EXPECT_LT(a.stage + 1, c.p * c.v) << a.to_string();
        EXPECT_NE(s.rank_of_stage(a.stage + 1), r) << a.to_string() << " sends to its own rank";
        EXPECT_EQ((n[{ActionKind::kRecvForward, a.stage + 1, a.microbatch}]), 1)
            << a.to_string() << " on rank " << r;
      } else if (a.kind == ActionKind::kSendBackward) {
        // SEND_B(s,m) feeds RECV_B(s-1,m).
        EXPECT_GE(a.stage - 1, 0) << a.to_string();
        EXPECT_NE(s.rank_of_stage(a.stage - 1), r) << a.to_string() << " sends to its own rank";
        EXPECT_EQ((n[{ActionKind::kRecvBackward, a.stage - 1, a.microbatch}]), 1)
            << a.to_string() << " on rank " << r;
      }
    }
  }
}

TEST_P(ScheduleStructure, EveryReceiveHasItsSend) {
  const Schedule s = generate();
  auto n = counts(s);
  for (int64_t r = 0; r < s.num_ranks(); ++r) {
    for (const Action& a : s.actions[r]) {
      if (a.kind == ActionKind::kRecvForward) {
        EXPECT_EQ((n[{ActionKind::kSendForward, a.stage - 1, a.microbatch}]), 1)
            << a.to_string() << " on rank " << r;
      } else if (a.kind == ActionKind::kRecvBackward) {
        EXPECT_EQ((n[{ActionKind::kSendBackward, a.stage + 1, a.microbatch}]), 1)
            << a.to_string() << " on rank " << r;
      }
    }
  }
}

TEST_P(ScheduleStructure, EveryBoundaryBetweenRanksIsSentBothWays) {
  // Stages s and s+1 on different ranks exchange an activation and a gradient per micro-batch.
  const auto& c = GetParam();
  const Schedule s = generate();
  auto n = counts(s);
  for (int64_t stage = 0; stage + 1 < c.p * c.v; ++stage) {
    if (s.rank_of_stage(stage) == s.rank_of_stage(stage + 1)) continue;
    for (int64_t mb = 0; mb < c.m; ++mb) {
      EXPECT_EQ((n[{ActionKind::kSendForward, stage, mb}]), 1) << "stage " << stage << " mb " << mb;
      EXPECT_EQ((n[{ActionKind::kSendBackward, stage + 1, mb}]), 1)
          << "stage " << stage + 1 << " mb " << mb;
    }
  }
}

TEST_P(ScheduleStructure, ReplaysWithoutDeadlockAndKeepsEveryRankBusyForItsShare) {
  // Each rank computes v m (F + B + W) = 3 v m with unit split costs (BW = 2), whatever the order.
  const auto& c = GetParam();
  SimulationResult result;
  ASSERT_NO_THROW(result = simulate(generate(), unit_split_costs()));
  for (int64_t r = 0; r < c.p; ++r) {
    EXPECT_NEAR(result.busy[r], 3.0 * double(c.v * c.m), kTolerance) << "rank " << r;
  }
  EXPECT_GE(result.makespan, 3.0 * double(c.v * c.m) - kTolerance);
}

TEST_P(ScheduleStructure, TextFormRoundTripsThroughParse) {
  const Schedule s = generate();
  const Schedule parsed = Schedule::parse(s.to_string());
  EXPECT_EQ(parsed.name, s.name);
  EXPECT_EQ(parsed.num_stages, s.num_stages);
  EXPECT_EQ(parsed.num_microbatches, s.num_microbatches);
  EXPECT_EQ(parsed.stages_per_rank, s.stages_per_rank);
  EXPECT_EQ(parsed.placement, s.placement);
  EXPECT_EQ(parsed.actions, s.actions);
}

TEST_P(ScheduleStructure, RunsUnderNcclOnceMadeSafe) {
  const Schedule safe = make_nccl_safe(generate());
  EXPECT_NO_THROW(simulate(safe, unit_split_costs(), CommSemantics::kNccl));
}

TEST_P(ScheduleStructure, StagesOfRankAndRankOfStageAgree) {
  const auto& c = GetParam();
  const Schedule s = generate();
  std::set<int64_t> seen;
  for (int64_t r = 0; r < c.p; ++r) {
    const auto stages = s.stages_of_rank(r);
    ASSERT_EQ(static_cast<int64_t>(stages.size()), c.v);
    for (size_t i = 0; i < stages.size(); ++i) {
      EXPECT_EQ(s.rank_of_stage(stages[i]), r);
      EXPECT_EQ(stages[i] / c.p, static_cast<int64_t>(i)) << "local stage i is chunk i";
      seen.insert(stages[i]);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), c.p * c.v);
}

INSTANTIATE_TEST_SUITE_P(Generators,
                         ScheduleStructure,
                         ::testing::ValuesIn(all_schedule_cases()),
                         schedule_case_name);

// ---- Text form -------------------------------------------------------------------------------

TEST(ScheduleText, ActionParseReadsKindStageAndMicrobatch) {
  const Action a = Action::parse("SEND_F(2,3)");
  EXPECT_EQ(a.kind, ActionKind::kSendForward);
  EXPECT_EQ(a.stage, 2);
  EXPECT_EQ(a.microbatch, 3);
}

TEST(ScheduleText, ActionParseReadsEveryKindName) {
  const std::vector<std::pair<std::string, ActionKind>> names = {
      {"F", ActionKind::kForward},
      {"B", ActionKind::kBackwardInput},
      {"W", ActionKind::kBackwardWeight},
      {"BW", ActionKind::kFullBackward},
      {"SEND_F", ActionKind::kSendForward},
      {"RECV_F", ActionKind::kRecvForward},
      {"SEND_B", ActionKind::kSendBackward},
      {"RECV_B", ActionKind::kRecvBackward},
  };
  for (const auto& [name, kind] : names) {
    EXPECT_EQ(Action::parse(name + "(1,4)"), (Action{kind, 1, 4})) << name;
  }
}

TEST(ScheduleText, ActionToStringWritesKindStageMicrobatch) {
  EXPECT_EQ((Action{ActionKind::kForward, 0, 3}).to_string(), "F(0,3)");
  EXPECT_EQ((Action{ActionKind::kRecvBackward, 5, 12}).to_string(), "RECV_B(5,12)");
}

TEST(ScheduleText, ActionParseRejectsAnUnknownKind) {
  const auto error = error_of([] { Action::parse("X(1,2)"); });
  EXPECT_TRUE(mentions(error, "unknown action kind 'X'"));
}

TEST(ScheduleText, ActionParseRejectsAMissingMicrobatch) {
  const auto error = error_of([] { Action::parse("F(1)"); });
  EXPECT_TRUE(mentions(error, "cannot read action 'F(1)'"));
}

TEST(ScheduleText, ParseIgnoresBlankAndCommentLines) {
  const Schedule s = make_schedule("1f1b", 2, 3);
  const std::string text = "\n# a note\n" + s.to_string() + "\n   \n# another\n";
  const Schedule parsed = Schedule::parse(text);
  EXPECT_EQ(parsed.name, "1f1b");
  EXPECT_EQ(parsed.actions, s.actions);
}

TEST(ScheduleText, ParseRejectsARankLineOutOfOrderNamingTheLine) {
  const std::string text =
      "# torch_mp schedule custom: num_stages=2 num_microbatches=1 stages_per_rank=1\n"
      "rank 1: F(1,0)\n"
      "rank 0: F(0,0)\n";
  const auto error = error_of([&] { Schedule::parse(text); });
  EXPECT_TRUE(mentions(error, "line 2"));
  EXPECT_TRUE(mentions(error, "expected rank 0, found rank 1"));
}

TEST(ScheduleText, ParseRejectsALineThatIsNeitherRankNorComment) {
  const auto error = error_of([] { Schedule::parse("rank 0: F(0,0) BW(0,0)\nhello\n"); });
  EXPECT_TRUE(mentions(error, "line 2"));
  EXPECT_TRUE(mentions(error, "neither 'rank R: ACTIONS' nor a comment"));
}

TEST(ScheduleText, ParseRejectsAnUnknownActionKindNamingTheLine) {
  const auto error = error_of([] { Schedule::parse("rank 0: F(0,0) X(1,2) BW(0,0)\n"); });
  EXPECT_TRUE(mentions(error, "unknown action kind 'X'"));
  EXPECT_TRUE(mentions(error, "line 1"));  // schedule.h: "Raises, naming the line"
}

TEST(ScheduleText, ParseRejectsAMalformedActionInARankLine) {
  // "F(1)" lacks its micro-batch; dropping it silently would change the schedule.
  const auto error = error_of([] { Schedule::parse("rank 0: F(0,0) F(1) BW(0,0)\n"); });
  EXPECT_TRUE(mentions(error, "F(1)"));
  EXPECT_TRUE(mentions(error, "line 1"));
}

TEST(ScheduleText, ParseRejectsTextWithoutRankLines) {
  EXPECT_TRUE(mentions(error_of([] { Schedule::parse("# nothing\n"); }), "no rank lines"));
}

// ---- make_schedule's errors ------------------------------------------------------------------

TEST(MakeScheduleErrors, RejectsAnUnknownName) {
  const auto error = error_of([] { make_schedule("pipedream", 2, 4); });
  EXPECT_TRUE(mentions(error, "unknown schedule 'pipedream'"));
}

TEST(MakeScheduleErrors, RejectsInterleavedWithOneStagePerRank) {
  const auto error = error_of([] { make_schedule("interleaved_1f1b", 4, 4, 1); });
  EXPECT_TRUE(mentions(error, "interleaved_1f1b needs stages_per_rank >= 2 (got 1)"));
}

TEST(MakeScheduleErrors, RejectsInterleavedWithMicrobatchesNotDivisibleByRanks) {
  // 8 stages, 2 per rank: 4 ranks; 6 micro-batches.
  const auto error = error_of([] { make_schedule("interleaved_1f1b", 8, 6, 2); });
  EXPECT_TRUE(
      mentions(error, "num_microbatches (6) divisible by the number of pipeline ranks (4)"));
}

TEST(MakeScheduleErrors, RejectsSeveralStagesPerRankForOneStageSchedules) {
  for (const char* name : {"gpipe", "1f1b", "zb_h1"}) {
    const auto error = error_of([&] { make_schedule(name, 4, 4, 2); });
    EXPECT_TRUE(mentions(error, "runs one stage per rank")) << name;
  }
}

TEST(MakeScheduleErrors, RejectsZbvWithoutTwoStagesPerRank) {
  for (int64_t v : {1, 3}) {
    const auto error = error_of([&] { make_schedule("zbv", 2 * v, 4, v); });
    EXPECT_TRUE(mentions(error, "zbv runs two stages per rank")) << "v " << v;
  }
  const auto error = error_of([] { make_schedule("interleaved_zb", 2, 4, 1); });
  EXPECT_TRUE(mentions(error, "interleaved_zb needs stages_per_rank >= 2 (got 1); use zb_h1"));
}

TEST(SchedulePlacement, VPutsTheFirstAndLastStageOnRankZero) {
  const Schedule s = make_schedule("zbv", 8, 8, 2);
  EXPECT_EQ(s.placement, Placement::kV);
  EXPECT_EQ(s.stages_of_rank(0), (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(s.stages_of_rank(3), (std::vector<int64_t>{3, 4}));
  EXPECT_TRUE(mentions(s.to_string(), "placement=v"));
  // Stages 3 and 4 share rank 3: nothing is sent between them.
  for (const Action& a : s.actions[3]) {
    EXPECT_FALSE(a.kind == ActionKind::kSendForward && a.stage == 3) << a.to_string();
  }
}

TEST(MakeScheduleErrors, RejectsStagesNotDivisibleByStagesPerRank) {
  const auto error = error_of([] { make_schedule("interleaved_1f1b", 5, 4, 2); });
  EXPECT_TRUE(mentions(error, "num_stages (5) must be divisible by stages_per_rank (2)"));
}

TEST(MakeScheduleErrors, RejectsNonPositiveSizes) {
  EXPECT_TRUE(mentions(error_of([] { make_schedule("1f1b", 0, 4); }), "must be positive"));
  EXPECT_TRUE(mentions(error_of([] { make_schedule("1f1b", 2, 0); }), "must be positive"));
  EXPECT_TRUE(mentions(error_of([] { make_schedule("1f1b", -2, 4); }), "must be positive"));
  EXPECT_TRUE(
      mentions(error_of([] { make_schedule("interleaved_1f1b", 4, 4, 0); }), "must be positive"));
}

TEST(MakeScheduleErrors, ScheduleNamesListsEveryGenerator) {
  EXPECT_EQ(schedule_names(),
            (std::vector<std::string>{
                "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb", "zbv"}));
}

// ---- simulate's errors -----------------------------------------------------------------------

TEST(SimulateErrors, RejectsAReceiveWithNoMatchingSend) {
  Schedule s = make_schedule("1f1b", 2, 2);
  remove_action(s, 0, "SEND_F(0,0)");
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "no matching send"));
  EXPECT_TRUE(mentions(error, "rank 1"));
  EXPECT_TRUE(mentions(error, "RECV_F(1,0)"));
}

TEST(SimulateErrors, RejectsASendThatNoRankReceives) {
  Schedule s = make_schedule("1f1b", 2, 2);
  remove_action(s, 0, "RECV_B(0,1)");
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "SEND_B(1,1)"));
  EXPECT_TRUE(mentions(error, "a send that no rank receives"));
}

TEST(SimulateErrors, ReportsADeadlockNamingBothWaitingRanks) {
  // Rank 0 waits for stage 1's gradient before it sends its activation; rank 1 waits for it.
  const Schedule s = hand_schedule(2,
                                   1,
                                   {{"RECV_B(0,0)", "F(0,0)", "SEND_F(0,0)", "BW(0,0)"},
                                    {"RECV_F(1,0)", "F(1,0)", "BW(1,0)", "SEND_B(1,0)"}});
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "deadlocks"));
  EXPECT_TRUE(mentions(error, "rank 0, step 0, RECV_B(0,0) waits for SEND_B(1,0) on rank 1"));
  EXPECT_TRUE(mentions(error, "rank 1, step 0, RECV_F(1,0) waits for SEND_F(0,0) on rank 0"));
}

TEST(SimulateErrors, RejectsAForwardOnARankThatDoesNotHoldItsStage) {
  Schedule s = make_schedule("1f1b", 2, 1);
  ASSERT_EQ(s.actions[0][0], Action::parse("F(0,0)"));
  s.actions[0][0] = Action::parse("F(1,0)");
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "rank 0, step 0, F(1,0)"));
  EXPECT_TRUE(mentions(error, "stage 1 lives on rank 1"));
}

TEST(SimulateErrors, RejectsAComputeActionBeforeItsReceive) {
  Schedule s = make_schedule("1f1b", 2, 1);
  const int64_t recv = position_of(s, 1, "RECV_F(1,0)");
  const int64_t forward = position_of(s, 1, "F(1,0)");
  ASSERT_EQ(forward, recv + 1);
  std::swap(s.actions[1][recv], s.actions[1][forward]);
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "breaks a dependency"));
  EXPECT_TRUE(mentions(error, "F(1,0)"));
  EXPECT_TRUE(mentions(error, "needs RECV_F(1,0)"));
  EXPECT_TRUE(mentions(error, "rank 1"));
}

TEST(SimulateErrors, RejectsABackwardBeforeItsForward) {
  const Schedule s = hand_schedule(1, 1, {{"BW(0,0)", "F(0,0)"}});
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "breaks a dependency"));
  EXPECT_TRUE(mentions(error, "needs F(0,0)"));
}

TEST(SimulateErrors, RejectsAStageAndMicrobatchThatNeverRunsItsBackward) {
  Schedule s = make_schedule("1f1b", 2, 2);
  remove_action(s, 0, "BW(0,1)");  // stage 0 sends no gradient, so nothing else depends on it
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "stage 0 micro-batch 1 never runs its backward"));
  EXPECT_TRUE(mentions(error, "rank 0"));
}

TEST(SimulateErrors, RejectsASplitBackwardWithoutItsWeightGradient) {
  Schedule s = make_schedule("zb_h1", 2, 2);
  remove_action(s, 1, "W(1,0)");
  const auto error = error_of([&] { simulate(s, unit_split_costs()); });
  EXPECT_TRUE(mentions(error, "stage 1 micro-batch 0 never runs its backward"));
}

TEST(SimulateErrors, RejectsAnActionThatRunsTwice) {
  const Schedule s = hand_schedule(1, 1, {{"F(0,0)", "F(0,0)", "BW(0,0)"}});
  const auto error = error_of([&] { simulate(s); });
  EXPECT_TRUE(mentions(error, "rank 0, step 1, F(0,0)"));
  EXPECT_TRUE(mentions(error, "runs twice"));
}

// ---- Communication latency -------------------------------------------------------------------

TEST(SimulateCommunication, OneMicrobatchOnTwoRanksTakesTwoForwardsTwoBackwardsAndTwoHops) {
  // F(0,0) [0,1] -> c -> F(1,0) [1+c,2+c], BW(1,0) [2+c,4+c] -> c -> BW(0,0) [4+2c,6+2c].
  for (double c : {0.0, 0.25, 0.5, 3.0}) {
    CostModel costs = forward1_backward2();
    costs.comm = c;
    const auto result = simulate(make_schedule("1f1b", 2, 1), costs);
    EXPECT_NEAR(result.makespan, 2 * 1.0 + 2 * 2.0 + 2 * c, kTolerance) << "comm " << c;
  }
}

TEST(SimulateCommunication, OneMicrobatchCrossesEveryBoundaryTwice) {
  // m = 1 is a chain: p forwards, p backwards, and 2 (p - 1) hops.
  for (int64_t p : {2, 3, 4, 8}) {
    CostModel costs = forward1_backward2();
    costs.comm = 0.5;
    const auto result = simulate(make_schedule("1f1b", p, 1), costs);
    EXPECT_NEAR(result.makespan, double(p) * 3.0 + 2.0 * double(p - 1) * 0.5, kTolerance)
        << "p " << p;
  }
}

TEST(SimulateCommunication, LatencyLengthensTheOneFOneBMakespan) {
  for (const auto& [p, m] : theory_sizes()) {
    CostModel with_latency = forward1_backward2();
    with_latency.comm = 0.5;
    const double without_latency =
        simulate(make_schedule("1f1b", p, m), forward1_backward2()).makespan;
    const double slow = simulate(make_schedule("1f1b", p, m), with_latency).makespan;
    EXPECT_GT(slow, without_latency) << "p " << p << ", m " << m;
  }
}

TEST(SimulateCommunication, ReceiveStartsWhenTheMessageArrives) {
  CostModel costs = forward1_backward2();
  costs.comm = 0.5;
  const auto result = simulate(make_schedule("1f1b", 2, 1), costs);
  bool found = false;
  for (const TimedAction& t : result.timeline) {
    if (t.action == Action::parse("F(1,0)")) {
      EXPECT_EQ(t.rank, 1);
      EXPECT_NEAR(t.start, 1.5, kTolerance);  // F(0,0) ends at 1, plus 0.5 in flight
      EXPECT_NEAR(t.end, 2.5, kTolerance);
      found = true;
    }
  }
  EXPECT_TRUE(found) << "F(1,0) is not in the timeline";
}

// ---- Cost model ------------------------------------------------------------------------------

TEST(SimulateCostModel, WithoutWeightASplitBackwardCostsHalfTheBackwardEach) {
  CostModel costs;
  costs.backward = 3.0;
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kFullBackward), 3.0);
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kBackwardInput), 1.5);
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kBackwardWeight), 1.5);
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kSendForward), 0.0);
}

TEST(SimulateCostModel, WithWeightAFullBackwardCostsBackwardPlusWeight) {
  CostModel costs;
  costs.backward = 1.0;
  costs.weight = 0.5;
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kFullBackward), 1.5);
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kBackwardInput), 1.0);
  EXPECT_DOUBLE_EQ(costs.cost(ActionKind::kBackwardWeight), 0.5);
}

}  // namespace
}  // namespace torch_mp::pipeline
