// torch_mp::clip_grad_norm_ from C++ equals torch::nn::utils::clip_grad_norm_ on the dense
// model: column and row shards summed over the tensor group, replicated parameters counted once,
// pipeline stages combined. Ranks are threads over real Gloo groups.

#include "torch_mp/optim/clip_grad.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <limits>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/tensor_parallel/linear.h"

namespace torch_mp {
namespace {

using testing::all_close;
namespace tp = tensor_parallel;

constexpr int64_t kWidth = 8;

torch::nn::Linear uniform_linear(int64_t in, int64_t out, uint64_t seed) {
  torch::nn::Linear linear(in, out);
  at::NoGradGuard no_grad;
  auto generator = testing::seeded_generator(seed);
  linear->weight.uniform_(-0.5, 0.5, generator);
  linear->bias.uniform_(-0.5, 0.5, generator);
  return linear;
}

struct ClipCase {
  int world;
  int64_t tp;
  int64_t pp;
  double norm_type;
};

class ClipGradNorm : public ::testing::TestWithParam<ClipCase> {};

TEST_P(ClipGradNorm, EqualsTheDenseModel) {
  const auto [world, tp_size, pp_size, norm_type] = GetParam();
  const auto x = testing::rank_randn({4, kWidth}, 1, 0);
  testing::run_on_mesh(world, testing::test_options(tp_size, pp_size), [&](const Mesh& mesh) {
    // One dense block (Linear -> tanh -> Linear -> plain Linear) per pipeline stage.
    std::vector<std::vector<torch::nn::Linear>> dense;
    std::vector<at::Tensor> all_params;
    for (int64_t stage = 0; stage < pp_size; ++stage) {
      dense.push_back({uniform_linear(kWidth, 2 * kWidth, 10 * stage + 1),
                       uniform_linear(2 * kWidth, kWidth, 10 * stage + 2),
                       uniform_linear(kWidth, kWidth, 10 * stage + 3)});
      auto& b = dense.back();
      b[2]->forward(b[1]->forward(b[0]->forward(x).tanh())).square().mean().backward();
      for (const auto& layer : b) {
        for (const auto& p : layer->parameters()) {
          all_params.push_back(p);
        }
      }
    }
    const auto& ref = dense[mesh.pp_rank()];
    auto column = tp::ColumnParallelLinearImpl::from_dense(
        ref[0], tp::ColumnParallelLinearOptions(kWidth, 2 * kWidth).group(mesh.tp_group));
    auto row = tp::RowParallelLinearImpl::from_dense(
        ref[1], tp::RowParallelLinearOptions(2 * kWidth, kWidth).group(mesh.tp_group));
    auto plain = uniform_linear(kWidth, kWidth, 10 * mesh.pp_rank() + 3);  // replicated
    plain->forward(row->forward(column->forward(x).tanh())).square().mean().backward();
    std::vector<at::Tensor> mine;
    for (const auto& module :
         std::vector<std::shared_ptr<torch::nn::Module>>{column.ptr(), row.ptr(), plain.ptr()}) {
      for (const auto& p : module->parameters()) {
        mine.push_back(p);
      }
    }
    const double max_norm = 0.05;
    const double expected = torch::nn::utils::clip_grad_norm_(all_params, max_norm, norm_type);
    const auto total = clip_grad_norm_(
        mine, max_norm, norm_type, mesh.tp_group, mesh.pp_group, /*error_if_nonfinite=*/false);
    EXPECT_TRUE(all_close(total.to(at::kDouble), at::scalar_tensor(expected, at::kDouble)))
        << "total norm";
    EXPECT_GT(expected, max_norm) << "the test must clip";
    const int64_t t = mesh.tp_size(), r = mesh.tp_rank();
    EXPECT_TRUE(all_close(column->weight.grad(), ref[0]->weight.grad().chunk(t, 0)[r]));
    EXPECT_TRUE(all_close(row->weight.grad(), ref[1]->weight.grad().chunk(t, 1)[r]));
    EXPECT_TRUE(all_close(row->bias.grad(), ref[1]->bias.grad()));
    EXPECT_TRUE(all_close(plain->weight.grad(), ref[2]->weight.grad()));
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes,
                         ClipGradNorm,
                         ::testing::Values(ClipCase{1, 1, 1, 2.0},
                                           ClipCase{2, 2, 1, 2.0},
                                           ClipCase{4, 4, 1, 1.0},
                                           ClipCase{4, 2, 2, 2.0},
                                           ClipCase{
                                               4, 2, 2, std::numeric_limits<double>::infinity()}),
                         [](const ::testing::TestParamInfo<ClipCase>& info) {
                           const auto& c = info.param;
                           return "tp" + std::to_string(c.tp) + "_pp" + std::to_string(c.pp) +
                                  (std::isinf(c.norm_type)
                                       ? std::string("_inf")
                                       : "_p" + std::to_string(static_cast<int>(c.norm_type)));
                         });

}  // namespace
}  // namespace torch_mp
