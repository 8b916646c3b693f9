// How a failure is named before it travels to every rank (failure.h: failure_of): by rank,
// stage, micro-batch and action, and by the peer for a timeout or a lost connection, which
// leave the group broken. (That it reaches every rank and that reset() recovers:
// pipeline_executor_test.cpp.)

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "tensor_checks.h"
#include "torch_mp/pipeline/action_plan.h"
#include "torch_mp/pipeline/failure.h"
#include "torch_mp/pipeline/schedule.h"

namespace torch_mp::pipeline {
namespace {

// 1F1B over 2 ranks, 2 micro-batches:
//   rank 0: F(0,0) SEND_F(0,0) F(0,1) SEND_F(0,1) RECV_B(0,0) BW(0,0) RECV_B(0,1) BW(0,1)
//   rank 1: RECV_F(1,0) F(1,0) BW(1,0) SEND_B(1,0) RECV_F(1,1) F(1,1) BW(1,1) SEND_B(1,1)
ActionPlan plan_of_rank(int64_t rank) {
  return plan_actions(make_schedule("1f1b", 2, 2), rank, /*train=*/true);
}

TEST(FailureOf, AReceiveThatTimedOutNamesThePeerThatStalled) {
  const auto failure =
      failure_of(std::runtime_error("Timed out waiting 3000ms"), plan_of_rank(1), 0, 1);
  EXPECT_EQ(std::string(failure.what()),
            "Pipeline: rank 1's RECV_F(1,0) from rank 0 (stage 0) got no answer within the "
            "group's timeout: rank 0 stalled, is slow, or failed without telling its peers: "
            "Timed out waiting 3000ms");
  EXPECT_EQ(failure.origin, 1);
  EXPECT_TRUE(failure.group_broken);
}

TEST(FailureOf, ASendThatLostItsConnectionAsksWhetherThePeerDied) {
  const auto failure =
      failure_of(std::runtime_error("Connection reset by peer"), plan_of_rank(0), 1, 0);
  EXPECT_EQ(std::string(failure.what()),
            "Pipeline: rank 0's SEND_F(0,0) to rank 1 (stage 1) lost its connection to rank 1 "
            "(did its process die?): Connection reset by peer");
  EXPECT_TRUE(failure.group_broken);
}

TEST(FailureOf, AnyOtherErrorIsNamedByRankStageMicrobatchAndAction) {
  const auto failure = failure_of(std::runtime_error("boom"), plan_of_rank(0), 2, 0);
  EXPECT_EQ(std::string(failure.what()),
            "Pipeline: rank 0, stage 0, micro-batch 1: F(0,1) failed: boom");
  EXPECT_FALSE(failure.group_broken);
}

TEST(FailureOf, AnErrorThatNamesItsPlaceAlreadyIsKeptAsItIs) {
  const auto text = "Pipeline: stage 1 (rank 1) failed on micro-batch 0 in F(1,0): boom";
  EXPECT_EQ(std::string(failure_of(std::runtime_error(text), plan_of_rank(1), 1, 1).what()), text);
}

TEST(FailureOf, AClosingCheckPastTheLastActionIsPrefixedOnce) {
  const auto plan = plan_of_rank(0);
  const auto index = plan.actions.size();
  EXPECT_EQ(std::string(failure_of(std::runtime_error("late"), plan, index, 0).what()),
            "Pipeline: late");
  EXPECT_EQ(std::string(failure_of(std::runtime_error("Pipeline: late"), plan, index, 0).what()),
            "Pipeline: late");
}

TEST(RaiseFailure, ARankWhereTheFailureDidNotBeginSaysWhereItStopped) {
  const auto plan = plan_of_rank(0);
  const PeerFailure failure("Pipeline: boom", /*origin=*/1, /*group_broken=*/false);
  EXPECT_EQ(testing::error_of([&] { raise_failure(failure, plan, 4, 0); }),
            "Pipeline: rank 0 stopped at RECV_B(0,0) because the step failed on rank 1: "
            "Pipeline: boom");
  EXPECT_EQ(testing::error_of([&] { raise_failure(failure, plan, 4, 1); }), "Pipeline: boom");
}

}  // namespace
}  // namespace torch_mp::pipeline
