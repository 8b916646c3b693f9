// What the executor knows of an action list before running it (action_plan.h): message numbers
// that agree on both ends of every transfer, the receives it posts ahead, when a send's buffers
// may go, and each stage's last backward. Checked against the schedules' text, worked by hand.

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "torch_mp/pipeline/action_plan.h"
#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {
namespace {

// 1F1B over 2 ranks, 2 micro-batches:
//   rank 0: F(0,0) SEND_F(0,0) F(0,1) SEND_F(0,1) RECV_B(0,0) BW(0,0) RECV_B(0,1) BW(0,1)
//   rank 1: RECV_F(1,0) F(1,0) BW(1,0) SEND_B(1,0) RECV_F(1,1) F(1,1) BW(1,1) SEND_B(1,1)
Schedule one_f_one_b() { return make_schedule("1f1b", 2, 2); }

TEST(ActionPlan, PeerStagesAreTheNeighboursEachTransferNames) {
  EXPECT_EQ(peer_stage({ActionKind::kSendForward, 2, 0}), 3);
  EXPECT_EQ(peer_stage({ActionKind::kRecvForward, 2, 0}), 1);
  EXPECT_EQ(peer_stage({ActionKind::kSendBackward, 2, 0}), 1);
  EXPECT_EQ(peer_stage({ActionKind::kRecvBackward, 2, 0}), 3);
}

TEST(ActionPlan, EverySendAndItsReceiveShareOneMessageNumberAndPointAtEachOther) {
  for (const auto& name : schedule_names()) {
    const bool interleaved = name.find("interleaved") == 0 || name == "zbv";
    const Schedule schedule = make_schedule(name, interleaved ? 4 : 2, 4, interleaved ? 2 : 1);
    std::vector<ActionPlan> plans;
    for (int64_t r = 0; r < schedule.num_ranks(); ++r) {
      plans.push_back(plan_actions(schedule, r, /*train=*/true));
    }
    const int64_t messages = 2 * schedule.num_stages * schedule.num_microbatches;
    for (int64_t r = 0; r < schedule.num_ranks(); ++r) {
      std::set<int64_t> sent;
      for (size_t i = 0; i < plans[r].actions.size(); ++i) {
        const Action& send = plans[r].actions[i];
        if (!is_send(send)) {
          continue;
        }
        const Route& route = plans[r].routes[i];
        EXPECT_TRUE(sent.insert(route.message).second) << name << ": " << send.to_string();
        EXPECT_GE(route.message, 0);
        EXPECT_LT(route.message, messages);
        // Its receive, as schedule.h names it: SEND_F(s,m) -> RECV_F(s+1,m), SEND_B(s,m) ->
        // RECV_B(s-1,m).
        const bool forward = send.kind == ActionKind::kSendForward;
        const Action recv{forward ? ActionKind::kRecvForward : ActionKind::kRecvBackward,
                          send.stage + (forward ? 1 : -1),
                          send.microbatch};
        const auto& peer = plans[route.peer];
        size_t j = 0;
        while (j < peer.actions.size() && !(peer.actions[j] == recv)) {
          ++j;
        }
        ASSERT_LT(j, peer.actions.size()) << name << ": no " << recv.to_string();
        EXPECT_EQ(peer.routes[j].message, route.message) << name << ": " << send.to_string();
        EXPECT_EQ(peer.routes[j].peer, r) << name << ": " << recv.to_string();
      }
    }
  }
}

TEST(ActionPlan, ReceivesAreListedInOrder) {
  const Schedule schedule = one_f_one_b();
  EXPECT_EQ(plan_actions(schedule, 0, true).receives, (std::vector<size_t>{4, 6}));
  EXPECT_EQ(plan_actions(schedule, 1, true).receives, (std::vector<size_t>{0, 4}));
}

TEST(ActionPlan, ASendIsReleasedByTheFirstReceiveItsPeerSentAfterTakingIt) {
  const Schedule schedule = one_f_one_b();
  // Rank 0: SEND_F(0,0) (1) is taken before rank 1 sends SEND_B(1,0), received at RECV_B(0,0)
  // (4); SEND_F(0,1) (3) before SEND_B(1,1), received at RECV_B(0,1) (6).
  const std::map<size_t, std::vector<size_t>> rank0{{4, {1}}, {6, {3}}};
  EXPECT_EQ(plan_actions(schedule, 0, true).sends_released_by, rank0);
  // Rank 1 receives nothing its peer sent after taking SEND_B(1,0): its sends wait to the end.
  EXPECT_TRUE(plan_actions(schedule, 1, true).sends_released_by.empty());
}

TEST(ActionPlan, EvaluationRunsTheForwardHalfOnly) {
  const Schedule schedule = one_f_one_b();
  const auto plan = plan_actions(schedule, 1, /*train=*/false);
  const std::vector<Action> expected{{ActionKind::kRecvForward, 1, 0},
                                     {ActionKind::kForward, 1, 0},
                                     {ActionKind::kRecvForward, 1, 1},
                                     {ActionKind::kForward, 1, 1}};
  EXPECT_EQ(plan.actions, expected);
  EXPECT_EQ(forward_only(schedule.actions[1]), expected);
  EXPECT_EQ(plan.receives, (std::vector<size_t>{0, 2}));
  EXPECT_TRUE(plan.sends_released_by.empty());
}

TEST(ActionPlan, LastBackwardsAreTheLastBWBAndWOfEachStage) {
  const auto one_f = plan_actions(one_f_one_b(), 0, true);
  ASSERT_EQ(one_f.last_backward.size(), 1u);
  EXPECT_EQ(one_f.last_backward[0].full, 7u);  // BW(0,1)
  EXPECT_EQ(one_f.last_backward[0].input, SIZE_MAX);
  EXPECT_EQ(one_f.last_backward[0].of(ActionKind::kFullBackward), 7u);
  // ZB-H1, rank 1: RECV_F(1,0) F(1,0) B(1,0) SEND_B(1,0) RECV_F(1,1) F(1,1) B(1,1) SEND_B(1,1)
  //                W(1,0) W(1,1)
  const auto zb = plan_actions(make_schedule("zb_h1", 2, 2), 1, true);
  EXPECT_EQ(zb.last_backward[0].of(ActionKind::kBackwardInput), 6u);
  EXPECT_EQ(zb.last_backward[0].of(ActionKind::kBackwardWeight), 9u);
  EXPECT_EQ(zb.last_backward[0].full, SIZE_MAX);
}

}  // namespace
}  // namespace torch_mp::pipeline
