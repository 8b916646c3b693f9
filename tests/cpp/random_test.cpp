// RngTracker: a named stream stands in for the default CPU generator inside a fork.

#include "torch_mp/random.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tensor_checks.h"

namespace torch_mp {
namespace {

using torch_mp::RngTracker;

TEST(RngTracker, ForkDrawsFromTheStreamAndRestoresTheDefault) {
  RngTracker tracker;
  tracker.add("stream", 42);
  at::manual_seed(7);
  const auto before = at::rand({3});
  at::Tensor inside;
  {
    auto fork = tracker.fork("stream");
    inside = at::rand({3});
  }
  const auto after = at::rand({3});

  at::manual_seed(7);
  EXPECT_TRUE(at::equal(before, at::rand({3})));
  EXPECT_TRUE(at::equal(after, at::rand({3}))) << "the default resumes where it was";
  at::manual_seed(42);
  EXPECT_TRUE(at::equal(inside, at::rand({3}))) << "the stream starts at its seed";
}

TEST(RngTracker, TheStreamAdvancesAcrossForks) {
  RngTracker tracker;
  tracker.add("stream", 5);
  at::Tensor first;
  at::Tensor second;
  {
    auto fork = tracker.fork("stream");
    first = at::rand({2});
  }
  {
    auto fork = tracker.fork("stream");
    second = at::rand({2});
  }
  at::manual_seed(5);
  EXPECT_TRUE(at::equal(first, at::rand({2})));
  EXPECT_TRUE(at::equal(second, at::rand({2})));
}

TEST(RngTracker, ForkingAnUnknownStreamRaises) {
  RngTracker tracker;
  const auto error = testing::error_of([&] { auto fork = tracker.fork("missing"); });
  EXPECT_TRUE(testing::mentions(error, "no stream 'missing' on cpu"));
}

}  // namespace
}  // namespace torch_mp
