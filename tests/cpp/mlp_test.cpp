// ParallelMLP against torch_mp::dense::MLP computed in the same thread without any parallelism,
// and the operator torch_mp::parallel_mlp (what the Python module calls) against the module.

#include "torch_mp/tensor_parallel/mlp.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <string>

#include "tensor_checks.h"
#include "tensor_parallel_fixture.h"
#include "thread_world.h"

namespace torch_mp {
namespace {

using tensor_parallel::ParallelMLPImpl;
using tensor_parallel::ParallelMLPOptions;
using testing::seeded_generator;
using namespace tp_testing;  // NOLINT: the fixtures and helpers every file here shares

dense::MLP seeded_mlp() {
  dense::MLP mlp(dense::MLPOptions(8, 16).activation("relu"));
  randomise_parameters(*mlp, 91, 0.5);
  return mlp;
}

TEST_P(TensorParallel, MLPShardsTorchMpsDenseMLPOutputAndGradients) {
  on_every_rank(world(), [](const Mesh& mesh) {
    const std::string where = "rank " + std::to_string(mesh.rank);
    auto mlp = seeded_mlp();
    auto parallel =
        ParallelMLPImpl::from_dense(mlp, ParallelMLPOptions(8, 16).group(mesh.tp_group));
    EXPECT_EQ(parallel->options.activation(), "relu") << where;
    const at::Tensor input = at::randn({5, 2, 8}, seeded_generator(92));
    const at::Tensor dense_x = input.clone().requires_grad_(true);
    const at::Tensor x = input.clone().requires_grad_(true);
    const at::Tensor dense_y = mlp(dense_x);
    const at::Tensor y = parallel(x);
    dense_y.square().sum().backward();
    y.square().sum().backward();
    EXPECT_TRUE(close(y, dense_y)) << "output, " << where;
    EXPECT_TRUE(close(x.grad(), dense_x.grad())) << "input grad, " << where;
    EXPECT_TRUE(close(parallel->fc1->weight.grad(), chunk_of(mlp->fc1->weight.grad(), 0, mesh)))
        << "fc1 weight grad, " << where;
    EXPECT_TRUE(close(parallel->fc2->weight.grad(), chunk_of(mlp->fc2->weight.grad(), 1, mesh)))
        << "fc2 weight grad, " << where;
    EXPECT_TRUE(close(parallel->fc2->bias.grad(), mlp->fc2->bias.grad()))
        << "fc2 bias grad, " << where;
  });
}

TEST_P(TensorParallel, TheMLPOperatorIsTheModulesForward) {
  on_every_rank(world(), [](const Mesh& mesh) {
    auto parallel =
        ParallelMLPImpl::from_dense(seeded_mlp(), ParallelMLPOptions(8, 16).group(mesh.tp_group));
    const at::Tensor x = at::randn({5, 2, 8}, seeded_generator(93));
    // The operator's options are the declared ParallelMLPOptions, by keyword after the
    // tensors and `training`.
    const auto op = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("torch_mp::parallel_mlp", "")
                        .typed<at::Tensor(const at::Tensor&,
                                          const at::Tensor&,
                                          const std::optional<at::Tensor>&,
                                          const at::Tensor&,
                                          const std::optional<at::Tensor>&,
                                          bool,
                                          int64_t,
                                          int64_t,
                                          bool,
                                          c10::string_view,
                                          double,
                                          bool,
                                          c10::string_view)>();
    const auto through_operator = op.call(x,
                                          parallel->fc1->weight,
                                          parallel->fc1->bias,
                                          parallel->fc2->weight,
                                          parallel->fc2->bias,
                                          /*training=*/true,
                                          8,
                                          16,
                                          true,
                                          "relu",
                                          0.0,
                                          false,
                                          group_name(mesh.tp_group));
    EXPECT_TRUE(at::equal(through_operator, parallel(x))) << "rank " << mesh.rank;
  });
}

}  // namespace
}  // namespace torch_mp
