// torch_mp::recompute: outputs and gradients equal those of the run without recomputation, with
// dropout drawn from both streams (the default generator and the RNG tracker's per-rank stream),
// and the streams go on afterwards as if nothing had been recomputed. A tracker draw run again
// inside a backward pass without recompute()'s scope is refused.

#include "torch_mp/recompute.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "tensor_checks.h"
#include "torch_mp/random.h"
#include "torch_mp/split_backward.h"

namespace torch_mp {
namespace {

using torch_mp::kModelParallelRng;
using torch_mp::region_dropout;
using torch_mp::rng_tracker;

struct Run {
  at::Tensor output, input_grad, weight_grad, drawn_before_backward, drawn_after_backward;
};

// A tensor-parallel region's worth of work: a matmul, dropout on the "shard" (per-rank stream),
// then dropout on the whole (default stream).
std::vector<at::Tensor> region(const std::vector<at::Tensor>& inputs) {
  const auto h = region_dropout(at::matmul(inputs[0], inputs[1]).relu(), 0.5, true);
  return {at::dropout(h, 0.3, true) * inputs[0].sum()};
}

Run run(bool recomputed) {
  at::manual_seed(3);
  rng_tracker().reset();
  rng_tracker().add(kModelParallelRng, 11);
  const auto x = at::randn({5, 4}).requires_grad_();
  const auto w = at::randn({4, 6}).requires_grad_();
  const auto y = recomputed ? recompute(region, {x, w})[0] : region({x, w})[0];
  Run result;
  result.output = y.detach();
  result.drawn_before_backward = region_dropout(at::ones({16}), 0.5, true);
  (y * y).sum().backward();
  result.drawn_after_backward = region_dropout(at::ones({16}), 0.5, true) * at::rand({16});
  result.input_grad = x.grad();
  result.weight_grad = w.grad();
  rng_tracker().reset();
  return result;
}

TEST(Recompute, EqualsTheRunWithoutRecomputationBitForBit) {
  const auto plain = run(false);
  const auto recomputed = run(true);
  EXPECT_TRUE(at::equal(plain.output, recomputed.output));
  EXPECT_TRUE(at::equal(plain.input_grad, recomputed.input_grad));
  EXPECT_TRUE(at::equal(plain.weight_grad, recomputed.weight_grad));
  EXPECT_TRUE(at::equal(plain.drawn_before_backward, recomputed.drawn_before_backward));
  EXPECT_TRUE(at::equal(plain.drawn_after_backward, recomputed.drawn_after_backward))
      << "after the backward, both streams are where they would be without recomputation";
}

TEST(Recompute, UnderTheZeroBubbleSplitItRecomputesOnceAndGivesEachGradientOnce) {
  // B asks for the input's gradient only: the node recomputes and runs the recomputed graph's
  // B, keeping its weight work; W runs that work, with no second recomputation.
  const auto run_split = [](bool recomputed, int& runs) {
    at::manual_seed(3);
    rng_tracker().reset();
    rng_tracker().add(kModelParallelRng, 11);
    const auto x = at::randn({5, 4}).requires_grad_();
    const auto w = at::randn({4, 6}).requires_grad_();
    const RecomputeFunction counted = [&](const std::vector<at::Tensor>& in) {
      ++runs;
      return region(in);
    };
    const auto y = recomputed ? recompute(counted, {x, w})[0] : counted({x, w})[0];
    WeightWork work;
    const auto dy = at::ones_like(y);
    const auto dx = backward_input({y}, {dy}, {x}, {w}, work)[0];
    const int after_b = runs;
    EXPECT_FALSE(w.grad().defined()) << "B computes no weight gradient";
    backward_weight(work);
    EXPECT_EQ(runs, after_b) << "W recomputes nothing";
    rng_tracker().reset();
    return std::vector<at::Tensor>{y.detach(), dx, w.grad()};
  };
  int plain_runs = 0;
  int recomputed_runs = 0;
  const auto plain = run_split(false, plain_runs);
  const auto recomputed = run_split(true, recomputed_runs);
  EXPECT_EQ(recomputed_runs, 2) << "the forward, and one recomputation";
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(plain[i], recomputed[i])) << i;
  }
}

TEST(Recompute, WithoutGradModeItJustRuns) {
  at::NoGradGuard no_grad;
  const auto x = at::randn({2, 4});
  const auto w = at::randn({4, 3});
  at::manual_seed(1);
  const auto direct = at::dropout(at::matmul(x, w), 0.5, true);
  at::manual_seed(1);
  const auto through = recompute(
      [](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::dropout(at::matmul(in[0], in[1]), 0.5, true)};
      },
      {x, w})[0];
  EXPECT_TRUE(at::equal(direct, through));
}

TEST(RandomState, RestoresTheDefaultGeneratorAndTheTrackersStreams) {
  rng_tracker().reset();
  rng_tracker().add(kModelParallelRng, 5);
  at::manual_seed(9);
  const auto state = RandomState::capture();
  const auto first = at::rand({4});
  const auto first_region = region_dropout(at::ones({8}), 0.5, true);
  state.restore();
  EXPECT_TRUE(at::equal(first, at::rand({4})));
  EXPECT_TRUE(at::equal(first_region, region_dropout(at::ones({8}), 0.5, true)));
  rng_tracker().reset();
}

// Runs region dropout again in its backward, as a reentrant checkpoint recomputes.
struct DrawsInBackward : torch::autograd::Function<DrawsInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::AutoGradMode grad_mode(true);
    return {region_dropout(grads[0], 0.5, true)};
  }
};

TEST(Recompute, ATrackerDrawRunAgainInsideABackwardIsRefused) {
  rng_tracker().reset();
  rng_tracker().add(kModelParallelRng, 5);
  const auto x = at::randn({4}).requires_grad_();
  const auto error = testing::error_of([&] { DrawsInBackward::apply(x).sum().backward(); });
  rng_tracker().reset();
  EXPECT_TRUE(testing::mentions(error, "inside a backward pass"));
  EXPECT_TRUE(testing::mentions(error, "torch_mp::recompute"));
}

}  // namespace
}  // namespace torch_mp
