// The schedules' text form, and the errors of make_schedule and simulate, each naming what is
// wrong; simulate's communication latency and cost model on hand-written schedules.

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "pipeline_schedule_support.h"
#include "tensor_checks.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"

namespace torch_mp::pipeline {
namespace {

using testing::error_of;
using testing::mentions;

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
