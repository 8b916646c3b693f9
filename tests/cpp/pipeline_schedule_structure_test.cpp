// The structure of every generated pipeline schedule (make_schedule at many sizes): one forward
// and one backward per stage and micro-batch on its stage's rank, every send matched by its
// receive, a deadlock-free replay, the text form round-tripping, safety under NCCL.

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

}  // namespace
}  // namespace torch_mp::pipeline
