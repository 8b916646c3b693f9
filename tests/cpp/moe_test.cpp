// Expert parallelism (moe/): the MoE whose experts are split over an expert group of 2 and 4
// thread-ranks equals the dense module on each rank's tokens (outputs, aux loss, and the expert
// and router gradients of the sum of the ranks' losses), dropless and with capacity; the
// dispatch's all-to-all moves rows by counts and back; bad settings raise on every rank. The
// Python tests cover both routers, top 1 and 2, and a step; these hold the C++ entry points to
// the same results.

#include "torch_mp/moe/moe.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <string>
#include <tuple>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"
#include "torch_mp/checkpoint/checkpoint.h"
#include "torch_mp/comm.h"
#include "torch_mp/data_parallel/data_parallel.h"
#include "torch_mp/moe/dispatch.h"

namespace torch_mp::moe {
namespace {

using testing::seeded_generator;

constexpr int64_t kHidden = 8, kFfn = 12, kExperts = 4;

at::Tensor tokens_of(int64_t rank) {  // a different number on every rank
  return at::randn({3 + 2 * rank, kHidden}, seeded_generator(10 + rank));
}

at::Tensor upstream_of(int64_t rank) {
  return at::randn({3 + 2 * rank, kHidden}, seeded_generator(20 + rank));
}

/// The same dense module on every thread-rank (drawn from a seed, not the shared generator).
dense::MoE seeded_dense(std::optional<double> capacity_factor,
                        const std::string& activation = "gelu") {
  dense::MoE moe(dense::MoEOptions(kHidden, kFfn, kExperts)
                     .capacity_factor(capacity_factor)
                     .activation(activation));
  tp_testing::randomise_parameters(*moe, 31, 0.5);
  return moe;
}

// (ep, capacity factor, activation)
using MoECase = std::tuple<int, std::optional<double>, std::string>;

class ExpertParallel : public ::testing::TestWithParam<MoECase> {};

TEST_P(ExpertParallel, EqualsTheDenseModuleOnEachRanksTokens) {
  const auto& [ep, capacity_factor, activation] = GetParam();
  auto options = testing::test_options(1);
  options.ep(ep);
  testing::run_on_mesh(ep, options, [&](const Mesh& mesh) {
    auto reference = seeded_dense(capacity_factor, activation);
    auto parallel = MoEImpl::from_dense(reference, mesh.ep_group);
    ASSERT_EQ(parallel->experts->num_experts, kExperts / ep);
    at::Tensor total;
    for (int64_t r = 0; r < ep; ++r) {  // the dense module on every rank's tokens
      const auto [y, aux] = reference->forward(tokens_of(r));
      const auto loss = (y * upstream_of(r)).sum() + aux;
      total = total.defined() ? total + loss : loss;
    }
    total.backward();
    const auto rank = mesh.ep_rank();
    const auto [y, aux] = parallel->forward(tokens_of(rank));
    const auto [want_y, want_aux] = reference->forward(tokens_of(rank));
    EXPECT_TRUE(testing::all_close(y, want_y.detach(), 1e-5, 1e-6)) << "output";
    EXPECT_TRUE(testing::all_close(aux, want_aux.detach(), 1e-5, 1e-7)) << "aux loss";
    ((y * upstream_of(rank)).sum() + aux).backward();
    // This rank's experts: every rank's tokens that went to them.
    const auto local = kExperts / ep;
    EXPECT_TRUE(
        testing::all_close(parallel->experts->fc1_weight.grad(),
                           reference->experts->fc1_weight.grad().narrow(0, rank * local, local),
                           1e-5,
                           1e-5))
        << "fc1 grad";
    EXPECT_TRUE(
        testing::all_close(parallel->experts->fc2_weight.grad(),
                           reference->experts->fc2_weight.grad().narrow(0, rank * local, local),
                           1e-5,
                           1e-5))
        << "fc2 grad";
    // The replicated router: the ranks' parts summed.
    EXPECT_TRUE(testing::all_close(comm::all_reduce(parallel->router->weight.grad(), mesh.ep_group),
                                   reference->router->weight.grad(),
                                   1e-5,
                                   1e-5))
        << "router grad";
    // And gathered back whole.
    EXPECT_TRUE(parallel->to_dense()->experts->fc1_weight.equal(reference->experts->fc1_weight));
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts,
                         ExpertParallel,
                         ::testing::Values(MoECase{2, std::nullopt, "gelu"},
                                           MoECase{4, std::nullopt, "gelu"},
                                           MoECase{2, 0.75, "gelu"},
                                           MoECase{2, std::nullopt, "swiglu"}),
                         [](const ::testing::TestParamInfo<MoECase>& info) {
                           return "ep" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_capacity_" : "_dropless_") +
                                  std::get<2>(info.param);
                         });

TEST(Experts, SwigluIsTheGatedUnitOfTheTwoHalvesOfFc1) {
  dense::Experts experts(kHidden, kFfn, 2, "swiglu");
  ASSERT_EQ(experts->fc1_weight.sizes(), (std::vector<int64_t>{2, 2 * kFfn, kHidden}));
  const auto x = at::randn({5, kHidden}, seeded_generator(3));
  const auto w1 = experts->fc1_weight[1];
  const auto gate = at::matmul(x, w1.narrow(0, 0, kFfn).t());
  const auto up = at::matmul(x, w1.narrow(0, kFfn, kFfn).t());
  const auto want = at::matmul(at::silu(gate) * up, experts->fc2_weight[1].t());
  EXPECT_TRUE(testing::all_close(experts->expert(1, x), want, 1e-6, 1e-6));
}

TEST(ExpertParallel, DataParallelReducesExpertGradientsOverTheExpertDataGroup) {
  // dp 4, ep 2: experts reduced over [0 2] and [1 3], divided by 4; the router over all four.
  auto options = testing::test_options(1);
  testing::run_on_mesh(4, options.ep(2), [](const Mesh& mesh) {
    auto reference = seeded_dense(std::nullopt);
    auto moe = MoEImpl::from_dense(reference, mesh.ep_group);
    DataParallel wrapped(moe.ptr(),
                         DataParallelOptions()
                             .group(mesh.dp_cp_group)
                             .expert_group(mesh.ep_group)
                             .expert_data_group(mesh.expert_dp_group));
    const int64_t rank = mesh.rank, local = kExperts / 2, first = mesh.ep_rank() * local;
    // Not overwritten by the data group's rank 0, which holds other experts.
    ASSERT_TRUE(
        moe->experts->fc1_weight.equal(reference->experts->fc1_weight.narrow(0, first, local)));
    at::Tensor total;
    for (int64_t r = 0; r < 4; ++r) {
      const auto [y, aux] = reference->forward(tokens_of(r));
      const auto loss = ((y * upstream_of(r)).sum() + aux) / 4;
      total = total.defined() ? total + loss : loss;
    }
    total.backward();
    wrapped->prepare_for_forward();
    const auto [y, aux] = moe->forward(tokens_of(rank));
    wrapped->prepare_for_backward();
    ((y * upstream_of(rank)).sum() + aux).backward();
    EXPECT_TRUE(testing::all_close(
        moe->router->weight.grad(), reference->router->weight.grad(), 1e-5, 1e-5))
        << "router grad";
    EXPECT_TRUE(testing::all_close(moe->experts->fc2_weight.grad(),
                                   reference->experts->fc2_weight.grad().narrow(0, first, local),
                                   1e-5,
                                   1e-5))
        << "fc2 grad";
  });
}

TEST(ExpertParallel, ACheckpointSavedAtEp2LoadsAtEp1And4) {
  // Saved on 4 ranks at ep 2: places 0 and 1 of the data group write (the experts of place 1
  // into a file of their own), places 2 and 3 are replicas.
  const auto path = ::testing::TempDir() + "/torch_mp_moe_ckpt";
  std::filesystem::remove_all(path);
  testing::run_on_mesh(4, testing::test_options(1).ep(2), [&](const Mesh& mesh) {
    auto moe = MoEImpl::from_dense(seeded_dense(std::nullopt), mesh.ep_group);
    checkpoint::save(path, {{moe.ptr()}}, nullptr, {}, std::make_shared<Mesh>(mesh));
  });
  for (const int ep : {1, 4}) {
    testing::run_on_mesh(ep, testing::test_options(1).ep(ep), [&](const Mesh& mesh) {
      MoE moe(dense::MoEOptions(kHidden, kFfn, kExperts), mesh.ep_group);
      checkpoint::load(path, {{moe.ptr()}}, nullptr, std::make_shared<Mesh>(mesh));
      const auto reference = seeded_dense(std::nullopt);
      const auto back = moe->to_dense();
      EXPECT_TRUE(back->experts->fc1_weight.equal(reference->experts->fc1_weight)) << "ep " << ep;
      EXPECT_TRUE(back->experts->fc2_weight.equal(reference->experts->fc2_weight)) << "ep " << ep;
      EXPECT_TRUE(back->router->weight.equal(reference->router->weight)) << "ep " << ep;
    });
  }
}

TEST(AllToAllRows, SendsRowsByCountsAndTheGradientBack) {
  auto options = testing::test_options(1);
  testing::run_on_mesh(2, options.ep(2), [](const Mesh& mesh) {
    const int64_t rank = mesh.ep_rank();
    // Rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and none to itself.
    const std::vector<int64_t> send =
        rank == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 0};
    const std::vector<int64_t> recv =
        rank == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 0};
    const auto x = (at::arange(3, at::kFloat) + 10 * rank).unsqueeze(1).requires_grad_(true);
    const auto y = all_to_all_rows(x, send, recv, mesh.ep_group);
    const auto want = rank == 0 ? at::tensor({0.f, 10.f, 11.f, 12.f}) : at::tensor({1.f, 2.f});
    EXPECT_TRUE(y.squeeze(1).equal(want)) << y;
    (y * (rank + 1)).sum().backward();
    // Each row's gradient is the weight of the rank that received it.
    const auto grad = rank == 0 ? at::tensor({1.f, 2.f, 2.f}) : at::tensor({1.f, 1.f, 1.f});
    EXPECT_TRUE(x.grad().squeeze(1).equal(grad)) << x.grad();
  });
}

TEST(ExpertParallel, BadSettingsRaiseOnEveryRank) {
  const auto errors = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1).ep(2); },
      [](const Mesh& mesh) { MoE(dense::MoEOptions(kHidden, kFfn, 3), mesh.ep_group); });
  testing::expect_every_rank_raised(errors, "num_experts (3) must be divisible by the expert");
  const auto disagree = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1).ep(2); },
      [](const Mesh& mesh) {
        MoE(dense::MoEOptions(kHidden, kFfn, kExperts).top_k(1 + mesh.ep_rank()), mesh.ep_group);
      });
  testing::expect_every_rank_raised(disagree, "MoE configuration must be the same");
  const auto wider = testing::run_on_mesh_collecting_errors(
      2,
      [](int) { return testing::test_options(1).ep(2); },
      [](const Mesh& mesh) {  // rank 1's tokens are wider than the module's: it cannot route them
        MoE moe(dense::MoEOptions(kHidden, kFfn, kExperts), mesh.ep_group);
        moe->forward(at::randn({5, kHidden + mesh.ep_rank()}));
      });
  testing::expect_every_rank_raised(wider, "pass different hidden sizes");
}

}  // namespace
}  // namespace torch_mp::moe
