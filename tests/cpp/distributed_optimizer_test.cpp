// torch_mp::DistributedOptimizer from C++: each AdamW step equals plain AdamW's on the same
// data-parallel layout bit for bit (and the whole batch's on one thread), learning-rate
// schedules and parameter groups included; each rank keeps 1/dp of the state; ranks whose
// parameters differ are refused. Ranks are threads over real Gloo groups.

#include "torch_mp/optim/distributed_optimizer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/schedulers/step_lr.h>

#include <filesystem>
#include <map>
#include <string>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/checkpoint/checkpoint.h"
#include "torch_mp/checkpoint/safetensors.h"
#include "torch_mp/comm.h"
#include "torch_mp/data_parallel/data_parallel.h"
#include "torch_mp/optim/clip_grad.h"

namespace torch_mp {
namespace {

using testing::all_close;

constexpr int64_t kZeroWidth = 6;
constexpr int64_t kZeroHidden = 10;

// Two linear layers drawn from their own generator (threads share the global one).
torch::nn::Sequential zero_test_model() {
  torch::nn::Sequential model(torch::nn::Linear(kZeroWidth, kZeroHidden),
                              torch::nn::Linear(kZeroHidden, kZeroWidth));
  at::NoGradGuard no_grad;
  auto generator = testing::seeded_generator(7);
  for (auto& p : model->parameters()) {
    p.uniform_(-0.5, 0.5, generator);
  }
  return model;
}

at::Tensor zero_test_loss(torch::nn::Sequential& model, const at::Tensor& x) {
  return model->forward(x).tanh().pow(2).mean();
}

int64_t adamw_state_elements(torch::optim::Optimizer& optimizer) {
  int64_t elements = 0;
  for (const auto& entry : optimizer.state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
    elements += adam.exp_avg().numel() + adam.exp_avg_sq().numel();
  }
  return elements;
}

// The first layer at the defaults' rate, the second at a rate of its own.
std::vector<torch::optim::OptimizerParamGroup> two_groups(const torch::nn::Sequential& model) {
  const auto params = model->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + 2));
  groups.emplace_back(std::vector<at::Tensor>(params.begin() + 2, params.end()),
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(5e-3).weight_decay(0.1)));
  return groups;
}

// One data-parallel step of a plain Sequential (DataParallel's module form, armed by hand).
void zero_test_step(torch::nn::Sequential& model,
                    DataParallel& dp,
                    torch::optim::Optimizer& optimizer,
                    const at::Tensor& x) {
  optimizer.zero_grad();
  dp->prepare_for_forward();
  auto loss = zero_test_loss(model, x);
  dp->prepare_for_backward();
  loss.backward();
  optimizer.step();
}

class DistributedOptimizerWorld : public ::testing::TestWithParam<int> {};

TEST_P(DistributedOptimizerWorld, StepsEqualAdamWOnTheSameLayoutAndTheWholeBatch) {
  const int world = GetParam();
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto reference = zero_test_model();
    auto plain = zero_test_model();
    auto sharded = zero_test_model();
    DataParallel plain_dp(plain.ptr(), DataParallelOptions().group(mesh.dp_group));
    DataParallel sharded_dp(sharded.ptr(), DataParallelOptions().group(mesh.dp_group));
    const auto defaults = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::optim::AdamW reference_opt(two_groups(reference), defaults);
    torch::optim::AdamW plain_opt(two_groups(plain), defaults);
    DistributedOptimizer zero(two_groups(sharded),
                              defaults,
                              DistributedOptimizerOptions()
                                  .group(mesh.dp_group)
                                  .bucket_cap_mb(1.5e-4));  // a bucket per ~40 elements
    EXPECT_GT(zero.shards().num_buckets(), 1u);
    torch::optim::StepLR reference_schedule(reference_opt, 1, 0.5);
    torch::optim::StepLR plain_schedule(plain_opt, 1, 0.5);
    torch::optim::StepLR zero_schedule(zero, 1, 0.5);
    double last_lr = 0;  // the second group's rate in the last step
    for (int step = 0; step < 3; ++step) {
      last_lr = plain_opt.param_groups()[1].options().get_lr();
      const auto x = testing::rank_randn({4 * world, kZeroWidth}, 50 + step, 0);
      reference_opt.zero_grad();
      zero_test_loss(reference, x).backward();
      reference_opt.step();
      const auto mine = x.chunk(world)[mesh.dp_rank()];
      zero_test_step(plain, plain_dp, plain_opt, mine);
      zero_test_step(sharded, sharded_dp, zero, mine);
      reference_schedule.step();
      plain_schedule.step();
      zero_schedule.step();
      const auto expected = reference->parameters();
      const auto same_layout = plain->parameters();
      const auto actual = sharded->parameters();
      for (size_t i = 0; i < actual.size(); ++i) {
        EXPECT_TRUE(at::equal(actual[i], same_layout[i])) << "step " << step << " param " << i;
        EXPECT_TRUE(all_close(actual[i], expected[i])) << "step " << step << " param " << i;
      }
    }
    EXPECT_LT(last_lr, 5e-3);  // the schedule took effect, and reached the local optimizer
    EXPECT_EQ(zero.local_optimizer().param_groups()[1].options().get_lr(), last_lr);
    // This rank's state: its 1/dp of the elements (the sum over the group is the whole).
    const int64_t whole = adamw_state_elements(plain_opt);
    const auto mine =
        comm::all_reduce(at::tensor({adamw_state_elements(zero.local_optimizer())}), mesh.dp_group);
    EXPECT_EQ(mine.item<int64_t>(), whole);
  });
}

TEST_P(DistributedOptimizerWorld, ShardedGradientsStepAsPlainAdamWWithClipping) {
  const int world = GetParam();
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto reference = zero_test_model();
    auto plain = zero_test_model();
    auto sharded = zero_test_model();
    DataParallel plain_dp(plain.ptr(), DataParallelOptions().group(mesh.dp_group));
    DataParallel sharded_dp(
        sharded.ptr(),
        DataParallelOptions().group(mesh.dp_group).shard_gradients(true).bucket_cap_mb(1.5e-4));
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::optim::AdamW reference_opt(reference->parameters(), options);
    torch::optim::AdamW plain_opt(plain->parameters(), options);
    // Handed the state its DataParallel made (the arrow runs optim -> data_parallel).
    DistributedOptimizer zero(sharded->parameters(),
                              options,
                              DistributedOptimizerOptions()
                                  .group(mesh.dp_group)
                                  .sharded_state(sharded_dp->sharded_state()));
    ASSERT_TRUE(zero.shards().gradients());
    ASSERT_EQ(zero.shards().gradients(), sharded_dp->sharded_state());
    const auto shared = std::make_shared<Mesh>(mesh);
    for (int step = 0; step < 3; ++step) {
      const auto x = testing::rank_randn({4 * world, kZeroWidth}, 80 + step, 0);
      const auto mine = x.chunk(world)[mesh.dp_rank()];
      reference_opt.zero_grad();
      zero_test_loss(reference, x).backward();
      const auto expected_norm = clip_grad_norm_(reference->parameters(), 0.05, 2.0, shared);
      reference_opt.step();
      for (auto* run : {&plain_dp, &sharded_dp}) {
        auto& model = run == &plain_dp ? plain : sharded;
        torch::optim::Optimizer& optimizer =
            run == &plain_dp ? static_cast<torch::optim::Optimizer&>(plain_opt) : zero;
        optimizer.zero_grad();
        (*run)->prepare_for_forward();
        auto loss = zero_test_loss(model, mine);
        (*run)->prepare_for_backward();
        loss.backward();
        const auto norm = clip_grad_norm_(model->parameters(), 0.05, 2.0, shared);
        EXPECT_TRUE(all_close(norm, expected_norm)) << "step " << step;
        optimizer.step();
      }
      for (const auto& p : sharded->parameters()) {
        EXPECT_FALSE(p.grad().defined()) << "the whole gradient was kept";
      }
      const auto expected = reference->parameters();
      const auto same_layout = plain->parameters();
      const auto actual = sharded->parameters();
      // Not bit for bit: the norm sums the pieces' squares, not whole tensors' norms, so the
      // clipping factor may differ in its last bit (and a reduce-scatter of more than two ranks
      // sums in another order than an all-reduce).
      for (size_t i = 0; i < actual.size(); ++i) {
        EXPECT_TRUE(all_close(actual[i], same_layout[i])) << "step " << step << " param " << i;
        EXPECT_TRUE(all_close(actual[i], expected[i])) << "step " << step << " param " << i;
      }
    }
  });
}

TEST_P(DistributedOptimizerWorld, TheShardedStateIsFoundFromTheParametersOrHanded) {
  const int world = GetParam();
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto model = zero_test_model();
    auto other = zero_test_model();
    DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group).shard_gradients(true));
    DataParallel other_dp(other.ptr(),
                          DataParallelOptions().group(mesh.dp_group).shard_gradients(true));
    const auto options = torch::optim::AdamWOptions(1e-2);
    // One lookup in one place (data_parallel/owners.h) finds what a DataParallel made.
    DistributedOptimizer found(
        model->parameters(), options, DistributedOptimizerOptions().group(mesh.dp_group));
    EXPECT_EQ(found.shards().gradients(), dp->sharded_state());
    // A state handed for parameters it does not hold is refused, naming the parameter.
    const auto error = testing::error_of([&] {
      DistributedOptimizer wrong(model->parameters(),
                                 options,
                                 DistributedOptimizerOptions()
                                     .group(mesh.dp_group)
                                     .sharded_state(other_dp->sharded_state()));
    });
    ASSERT_TRUE(error.has_value());
    EXPECT_TRUE(testing::mentions(*error, "is not in the DataParallel(shard_gradients=True)"))
        << *error;
    EXPECT_EQ(DataParallel(zero_test_model().ptr(), DataParallelOptions().group(mesh.dp_group))
                  ->sharded_state(),
              nullptr);
  });
}

TEST_P(DistributedOptimizerWorld, Fp32MastersOfBf16ParametersEqualTheRecipeByHand) {
  const int world = GetParam();
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto model = zero_test_model();
    auto by_hand = zero_test_model();
    model->to(at::kBFloat16);
    by_hand->to(at::kBFloat16);
    // (Averaging the same gradient over 1, 2 or 4 ranks is exact in bf16.)
    DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group));
    DistributedOptimizer zero(
        model->parameters(),
        torch::optim::AdamOptions(1e-2),
        DistributedOptimizerOptions().group(mesh.dp_group).master_dtype(at::kFloat));
    std::vector<at::Tensor> masters;
    for (const auto& p : by_hand->parameters()) {
      masters.push_back(p.detach().to(at::kFloat));
    }
    torch::optim::Adam hand_opt(masters, torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      // The same batch on every rank, so no reduction is needed to compare.
      const auto x = testing::rank_randn({8, kZeroWidth}, 60 + step, 0).to(at::kBFloat16);
      zero_test_step(model, dp, zero, x);
      for (auto& p : by_hand->parameters()) {
        p.mutable_grad().reset();
      }
      zero_test_loss(by_hand, x).backward();
      const auto params = by_hand->parameters();
      for (size_t i = 0; i < masters.size(); ++i) {
        masters[i].mutable_grad() = params[i].grad().to(at::kFloat);
      }
      hand_opt.step();
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < masters.size(); ++i) {
        params[i].copy_(masters[i]);  // rounded to bf16
      }
      const auto actual = model->parameters();
      for (size_t i = 0; i < actual.size(); ++i) {
        EXPECT_EQ(actual[i].scalar_type(), at::kBFloat16);
        EXPECT_TRUE(at::equal(actual[i], params[i])) << "step " << step << " param " << i;
      }
    }
  });
}

TEST_P(DistributedOptimizerWorld, Bf16WithFp32MainGradientsEqualsTheRecipeByHand) {
  const int world = GetParam();
  constexpr int kMicrobatches = 2;
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto model = zero_test_model();
    auto by_hand = zero_test_model();
    model->to(at::kBFloat16);
    by_hand->to(at::kBFloat16);
    DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group).grad_dtype(at::kFloat));
    DistributedOptimizer zero(
        model->parameters(),
        torch::optim::AdamOptions(1e-2),
        DistributedOptimizerOptions().group(mesh.dp_group).master_dtype(at::kFloat));
    std::vector<at::Tensor> masters;
    for (const auto& p : by_hand->parameters()) {
      masters.push_back(p.detach().to(at::kFloat));
    }
    torch::optim::Adam hand_opt(masters, torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      const auto x = testing::rank_randn({4 * world * kMicrobatches, kZeroWidth}, 90 + step, 0)
                         .to(at::kBFloat16);
      const auto rows = x.chunk(world * kMicrobatches);
      zero.zero_grad();
      for (int m = 0; m < kMicrobatches; ++m) {  // the last micro-batch synced
        const auto& mine = rows[mesh.dp_rank() * kMicrobatches + m];
        dp->prepare_for_forward();
        auto loss = zero_test_loss(model, mine) / kMicrobatches;
        if (m == kMicrobatches - 1) {
          dp->prepare_for_backward();
        }
        loss.backward();
      }
      zero.step();
      // By hand: each rank's micro-batches' bf16 gradients summed in fp32, then averaged.
      std::vector<at::Tensor> main;
      for (const auto& master : masters) {
        main.push_back(at::zeros_like(master));
      }
      const auto params = by_hand->parameters();
      for (int r = 0; r < world; ++r) {
        std::vector<at::Tensor> ranks_main;
        for (const auto& master : masters) {
          ranks_main.push_back(at::zeros_like(master));
        }
        for (int m = 0; m < kMicrobatches; ++m) {
          for (auto& p : params) {
            p.mutable_grad().reset();
          }
          (zero_test_loss(by_hand, rows[r * kMicrobatches + m]) / kMicrobatches).backward();
          for (size_t i = 0; i < params.size(); ++i) {
            ranks_main[i] += params[i].grad().to(at::kFloat);
          }
        }
        for (size_t i = 0; i < main.size(); ++i) {
          main[i] += ranks_main[i] / world;
        }
      }
      for (size_t i = 0; i < masters.size(); ++i) {
        masters[i].mutable_grad() = main[i];
      }
      hand_opt.step();
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < masters.size(); ++i) {
          params[i].copy_(masters[i]);
        }
      }
      const auto actual = model->parameters();
      for (size_t i = 0; i < actual.size(); ++i) {
        if (world <= 2) {  // (a sum of two terms has one order)
          EXPECT_TRUE(at::equal(actual[i], params[i])) << "step " << step << " param " << i;
        } else {
          EXPECT_TRUE(at::allclose(actual[i], params[i], 1e-2, 1e-2)) << "step " << step;
        }
      }
    }
  });
}

TEST(DistributedOptimizer, APlainOptimizerOverShardedGradientsIsCaughtAtTheNextStep) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1); },
      [](const Mesh& mesh) {
        auto model = zero_test_model();
        DataParallel dp(model.ptr(),
                        DataParallelOptions().group(mesh.dp_group).shard_gradients(true));
        torch::optim::AdamW plain(model->parameters(), torch::optim::AdamWOptions(1e-2));
        for (int step = 0; step < 2; ++step) {
          zero_test_step(model, dp, plain, testing::rank_randn({4, kZeroWidth}, 99, 0));
        }
      });
  for (const auto& error : errors) {
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("not stepped by a torch_mp::DistributedOptimizer"), std::string::npos)
        << *error;
  }
}

TEST(DistributedOptimizer, ParametersThatDifferAcrossRanksRaiseOnEveryRank) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1); },
      [](const Mesh& mesh) {
        torch::nn::Linear layer(kZeroWidth + mesh.dp_rank(), kZeroWidth);
        DistributedOptimizer zero(layer->parameters(),
                                  torch::optim::AdamWOptions(1e-3),
                                  DistributedOptimizerOptions().group(mesh.dp_group));
      });
  for (const auto& error : errors) {
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("DistributedOptimizer"), std::string::npos) << *error;
  }
}

TEST_P(DistributedOptimizerWorld, AnOverlappedAllGatherIsWaitedForByTheNextForward) {
  testing::run_on_mesh(GetParam(), testing::test_options(1), [&](const Mesh& mesh) {
    auto plain_model = zero_test_model();
    auto model = zero_test_model();
    DataParallel plain_dp(plain_model.ptr(), DataParallelOptions().group(mesh.dp_group));
    DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group));
    const auto options = DistributedOptimizerOptions().group(mesh.dp_group).bucket_cap_mb(1e-4);
    DistributedOptimizer plain(
        plain_model->parameters(), torch::optim::AdamWOptions(1e-2), options);
    DistributedOptimizer zero(model->parameters(),
                              torch::optim::AdamWOptions(1e-2),
                              DistributedOptimizerOptions(options).overlap_param_gather(true));
    for (int step = 0; step < 3; ++step) {
      const auto x = testing::rank_randn({4, kZeroWidth}, 80 + step, mesh.dp_rank());
      zero_test_step(plain_model, plain_dp, plain, x);
      zero_test_step(model, dp, zero, x);  // its forward waits for the last step's all-gather
    }
    zero.wait_for_parameters();
    EXPECT_EQ(zero.shards().pending_gathers(), 0u);
    const auto expected = plain_model->parameters();
    const auto actual = model->parameters();
    for (size_t i = 0; i < actual.size(); ++i) {
      EXPECT_TRUE(at::equal(actual[i], expected[i])) << "param " << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds,
                         DistributedOptimizerWorld,
                         ::testing::Values(1, 2, 4),
                         testing::world_size_name);

// Two AdamW steps at dp = world (every rank the same batch), then a checkpoint at `path`.
template <typename MakeOptimizer>
void zero_train_and_save(int world, const std::string& path, const MakeOptimizer& make) {
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto model = zero_test_model();
    DataParallel dp(model.ptr(), DataParallelOptions().group(mesh.dp_group));
    auto optimizer = make(model, mesh);
    for (int step = 0; step < 2; ++step) {
      zero_test_step(model, dp, *optimizer, testing::rank_randn({8, kZeroWidth}, 70 + step, 0));
    }
    checkpoint::save(path, {{model.ptr()}}, optimizer.get(), {}, std::make_shared<Mesh>(mesh));
  });
}

// Loads `from` at dp = world into a DistributedOptimizer and saves it again to `to`.
void zero_reload(int world, const std::string& from, const std::string& to) {
  testing::run_on_mesh(world, testing::test_options(1), [&](const Mesh& mesh) {
    auto model = zero_test_model();
    DistributedOptimizer zero(model->parameters(),
                              torch::optim::AdamWOptions(1e-2),
                              DistributedOptimizerOptions().group(mesh.dp_group));
    const auto shared = std::make_shared<Mesh>(mesh);
    checkpoint::load(from, {{model.ptr()}}, &zero, shared);
    checkpoint::save(to, {{model.ptr()}}, &zero, {}, shared);
  });
}

std::map<std::string, at::Tensor> zero_checkpoint_contents(const std::string& path) {
  std::map<std::string, at::Tensor> all;
  for (const std::string prefix : {"model/", "optim/"}) {
    const auto file = path + ".dense.safetensors";
    checkpoint::consolidate(path, file, prefix);
    for (auto& [name, tensor] : checkpoint::load_file(file)) {
      all[prefix + name] = tensor;
    }
    std::filesystem::remove(file);
  }
  return all;
}

std::string zero_checkpoint_dir(const std::string& name) {
  const auto path = ::testing::TempDir() + "/torch_mp_zero_" + name;
  std::filesystem::remove_all(path);
  return path;
}

TEST(DistributedOptimizer, CheckpointsArePlainAdamWsAndLoadAtAnyDataParallelSize) {
  const auto plain = zero_checkpoint_dir("plain");
  const auto sharded = zero_checkpoint_dir("sharded");
  zero_train_and_save(2, plain, [](torch::nn::Sequential& model, const Mesh&) {
    return std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                 torch::optim::AdamWOptions(1e-2));
  });
  zero_train_and_save(2, sharded, [](torch::nn::Sequential& model, const Mesh& mesh) {
    return std::make_unique<DistributedOptimizer>(
        model->parameters(),
        torch::optim::AdamWOptions(1e-2),
        DistributedOptimizerOptions().group(mesh.dp_group).bucket_cap_mb(1.5e-4));
  });
  const auto expected = zero_checkpoint_contents(plain);
  EXPECT_TRUE(expected.count("optim/0.weight/exp_avg_sq"));
  EXPECT_TRUE(expected.count("optim/1.bias/step"));
  for (const auto& [label, path] :
       std::map<std::string, std::string>{{"dp 2", sharded}, {"dp 1", ""}, {"dp 4", ""}}) {
    std::string saved = path;
    if (saved.empty()) {  // loaded at another size, saved again
      saved = zero_checkpoint_dir("again");
      zero_reload(label == "dp 1" ? 1 : 4, sharded, saved);
    }
    const auto contents = zero_checkpoint_contents(saved);
    ASSERT_EQ(contents.size(), expected.size()) << label;
    for (const auto& [name, tensor] : expected) {
      EXPECT_TRUE(contents.at(name).equal(tensor)) << name << " at " << label;
    }
  }
}

}  // namespace
}  // namespace torch_mp
