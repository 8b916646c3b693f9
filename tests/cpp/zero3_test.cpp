// ZeRO-3 from C++: DataParallelOptions().shard_parameters(true).units({"Block"}) with a
// DistributedOptimizer trains exactly as one process does, holds no parameter element whole
// between steps, and checkpoints through the gathered parameters. Ranks are threads over real
// Gloo groups.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/checkpoint/checkpoint.h"
#include "torch_mp/data_parallel/data_parallel.h"
#include "torch_mp/data_parallel/shard_layout.h"
#include "torch_mp/optim/distributed_optimizer.h"

namespace torch_mp::zero3_test {

using testing::all_close;

constexpr int64_t kWidth = 6;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kWidth, 2 * kWidth));
    fc2 = register_module("fc2", torch::nn::Linear(2 * kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2->forward(at::gelu(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// An input layer, two blocks and an output layer, drawn from their own generator (threads
// share the global one).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    inp = register_module("inp", torch::nn::Linear(kWidth, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block()));
    out = register_module("out", torch::nn::Linear(kWidth, kWidth));
    at::NoGradGuard no_grad;
    auto generator = testing::seeded_generator(7);
    for (auto& p : parameters()) {
      p.uniform_(-0.5, 0.5, generator);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = inp->forward(x);
    for (const auto& block : *blocks) {
      h = block->as<Block>()->forward(h);
    }
    return out->forward(h);
  }
  torch::nn::Linear inp{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

at::Tensor batch(int64_t seed) { return testing::rank_randn({8, kWidth}, seed, 0); }

at::Tensor loss_of(const at::Tensor& out, int64_t seed) {
  return (out - testing::rank_randn(out.sizes(), seed, 0)).pow(2).mean();
}

// This rank's rows of a batch every rank draws alike.
at::Tensor mine(const at::Tensor& t, const Mesh& mesh) {
  return t.chunk(mesh.dp_size())[mesh.dp_rank()];
}

int64_t held(const Net& net) {
  int64_t n = 0;
  for (const auto& p : net->parameters()) {
    n += p.numel();
  }
  return n;
}

class Zero3 : public ::testing::TestWithParam<int> {};

TEST_P(Zero3, TrainsAsOneProcessHoldingOnlyItsRangeBetweenSteps) {
  for (const std::vector<std::string>& units :
       {std::vector<std::string>{"Block"}, std::vector<std::string>{}}) {
    testing::run_on_mesh(GetParam(), testing::test_options(1), [&](const Mesh& mesh) {
      Net reference;
      torch::optim::AdamW reference_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
      Net net;
      DataParallel dp(
          net, DataParallelOptions().group(mesh.dp_group).shard_parameters(true).units(units));
      DistributedOptimizer zero(net->parameters(),
                                torch::optim::AdamWOptions(1e-2),
                                DistributedOptimizerOptions().group(mesh.dp_group));
      EXPECT_EQ(held(net), 0);
      for (int64_t step = 0; step < 3; ++step) {
        reference_opt.zero_grad();
        loss_of(reference->forward(batch(step)), 100 + step).backward();
        reference_opt.step();
        zero.zero_grad();
        const auto y = mine(testing::rank_randn({8, kWidth}, 100 + step, 0), mesh);
        (dp->forward(mine(batch(step), mesh)) - y).pow(2).mean().backward();
        zero.step();
        EXPECT_EQ(held(net), 0) << "step " << step;
      }
      auto whole = dp->gathered_parameters();
      const auto expected = reference->named_parameters();
      for (const auto& item : net->named_parameters()) {
        EXPECT_TRUE(all_close(item.value(), expected[item.key()])) << item.key();
      }
    });
  }
}

// The sharded state reports what it holds by kind, and its layout's arithmetic
// (data_parallel::sharded_bytes, what plan::estimate counts ZeRO-2/3 with) says the same: to the
// byte for the main gradients, the reduced ranges and the parameters' shards, and as a bound
// for the staging, whose use depends on which buckets share a buffer.
TEST_P(Zero3, TheStateHoldsWhatItsLayoutsArithmeticSays) {
  struct Case {
    bool shard_parameters;
    std::optional<at::ScalarType> grad_dtype;
  };
  for (const Case& c : {Case{false, std::nullopt}, Case{false, at::kFloat}, Case{true, {}}}) {
    testing::run_on_mesh(GetParam(), testing::test_options(1), [&](const Mesh& mesh) {
      Net net;
      auto options = DataParallelOptions().group(mesh.dp_group).grad_dtype(c.grad_dtype);
      DataParallel dp(net,
                      c.shard_parameters ? options.shard_parameters(true).units({"Block"})
                                         : options.shard_gradients(true).bucket_cap_mb(1e-4));
      const auto state = dp->sharded_state();
      ASSERT_TRUE(state);
      DistributedOptimizer zero(
          net->parameters(),
          torch::optim::AdamWOptions(1e-2),
          DistributedOptimizerOptions().group(mesh.dp_group).sharded_state(state));
      for (int64_t step = 0; step < 2; ++step) {
        zero.zero_grad();
        const auto y = mine(testing::rank_randn({8, kWidth}, 100 + step, 0), mesh);
        (dp->forward(mine(batch(step), mesh)) - y).pow(2).mean().backward();
        zero.step();
      }
      const auto held = state->bytes();
      const auto said = data_parallel::sharded_bytes(
          state->layout(), mesh.dp_size(), c.grad_dtype, c.shard_parameters);
      EXPECT_EQ(held.main_gradients, said.main_gradients);
      EXPECT_EQ(held.reduced_gradients, said.reduced_gradients);
      EXPECT_EQ(held.parameter_shards, said.parameter_shards);
      EXPECT_LE(held.staging, said.staging);
      EXPECT_EQ(held.staging > 0, said.staging > 0);
      EXPECT_GT(held.total(), 0);
    });
  }
}

TEST_P(Zero3, ACheckpointSavedAtZero3LoadsIntoAPlainModel) {
  const auto path =
      std::filesystem::temp_directory_path() /
      ("torch_mp_zero3_" + std::to_string(GetParam()) + "_" + std::to_string(::getpid()));
  testing::run_on_mesh(GetParam(), testing::test_options(1), [&](const Mesh& mesh) {
    const auto shared = std::make_shared<Mesh>(mesh);
    Net net;
    DataParallel dp(
        net, DataParallelOptions().group(mesh.dp_group).shard_parameters(true).units({"Block"}));
    DistributedOptimizer zero(net->parameters(),
                              torch::optim::AdamWOptions(1e-2),
                              DistributedOptimizerOptions().group(mesh.dp_group));
    for (int64_t step = 0; step < 2; ++step) {
      zero.zero_grad();
      loss_of(dp->forward(mine(batch(step), mesh)), 100 + step).backward();
      zero.step();
    }
    checkpoint::save(path.string(), {{net.ptr()}}, &zero, {}, shared);
    EXPECT_EQ(held(net), 0);
    Net plain;
    checkpoint::load(path.string(), {{plain.ptr()}}, nullptr, shared);
    Net again;  // and back into ZeRO-3
    DataParallel again_dp(again, DataParallelOptions().group(mesh.dp_group).shard_parameters(true));
    checkpoint::load(path.string(), {{again.ptr()}}, nullptr, shared);
    auto whole = dp->gathered_parameters();
    auto whole_again = again_dp->gathered_parameters();
    const auto loaded = plain->named_parameters();
    const auto reloaded = again->named_parameters();
    for (const auto& item : net->named_parameters()) {
      EXPECT_TRUE(at::equal(item.value(), loaded[item.key()])) << item.key();
      EXPECT_TRUE(at::equal(item.value(), reloaded[item.key()])) << item.key();
    }
  });
  std::filesystem::remove_all(path);
}

TEST(Zero3Units, AContainerNamedAsAUnitIsRefused) {
  testing::run_on_mesh(2, testing::test_options(1), [&](const Mesh& mesh) {
    Net net;
    const auto error = testing::error_of([&] {
      DataParallel dp(
          net,
          DataParallelOptions().group(mesh.dp_group).shard_parameters(true).units({"ModuleList"}));
    });
    EXPECT_TRUE(testing::mentions(error, "blocks, a torch::nn::ModuleListImpl, which is never"));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Zero3, ::testing::Values(1, 2, 4));

}  // namespace torch_mp::zero3_test
