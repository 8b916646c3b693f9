// A batch split into micro-batches along dim 0 and joined back (microbatches.h), against slices
// taken by hand.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tensor_checks.h"
#include "torch_mp/pipeline/microbatches.h"

namespace torch_mp::pipeline {
namespace {

using testing::error_of;
using testing::mentions;

TEST(Microbatches, SplitGivesEachMicrobatchItsRowsOfEveryTensor) {
  const auto x = at::arange(12, at::kFloat).reshape({6, 2});
  const auto ids = at::arange(6, at::kLong);
  const auto parts = split_microbatches({x, ids}, 3);
  ASSERT_EQ(parts.size(), 3u);
  for (int64_t m = 0; m < 3; ++m) {
    ASSERT_EQ(parts[m].size(), 2u);
    EXPECT_TRUE(parts[m][0].equal(x.slice(0, 2 * m, 2 * m + 2))) << "micro-batch " << m;
    EXPECT_TRUE(parts[m][1].equal(ids.slice(0, 2 * m, 2 * m + 2))) << "micro-batch " << m;
  }
}

TEST(Microbatches, ABatchThatDoesNotDivideIsRefusedNamingItsSize) {
  const auto error = error_of([] { split_microbatches({at::zeros({5, 3})}, 2); });
  EXPECT_TRUE(mentions(error, "the batch size (5) of a [Float[5, 3]] tensor"));
  EXPECT_TRUE(mentions(error, "must be divisible by num_microbatches (2)"));
}

TEST(Microbatches, ANonPositiveCountIsRefused) {
  EXPECT_TRUE(mentions(error_of([] { split_microbatches({at::zeros({4})}, 0); }),
                       "num_microbatches must be positive, got 0"));
}

TEST(Microbatches, JoinConcatenatesEachTensorOverTheMicrobatches) {
  const auto x = at::randn({8, 3});
  const auto y = at::randn({8});
  const auto joined = join_microbatches(
      {{x.slice(0, 0, 4), y.slice(0, 0, 4)}, {x.slice(0, 4, 8), y.slice(0, 4, 8)}});
  ASSERT_EQ(joined.size(), 2u);
  EXPECT_TRUE(joined[0].equal(x));
  EXPECT_TRUE(joined[1].equal(y));
  EXPECT_TRUE(join_microbatches({}).empty());
}

TEST(Microbatches, TensorsAreDescribedByDtypeAndShape) {
  EXPECT_EQ(describe_tensors({at::zeros({4, 16}), at::zeros({4}, at::kLong)}),
            "[Float[4, 16], Long[4]]");
  EXPECT_EQ(describe_tensors({}), "[]");
}

}  // namespace
}  // namespace torch_mp::pipeline
