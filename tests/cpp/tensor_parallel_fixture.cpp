// The world sizes every tensor-parallel test runs at (tensor_parallel_fixture.h): instantiated
// once here for the suites the per-layer test files add their cases to.

#include "tensor_parallel_fixture.h"

#include "thread_world.h"

namespace torch_mp::tp_testing {
namespace {

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         TensorParallel,
                         ::testing::Values(1, 2, 4),
                         testing::world_size_name);

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         TensorParallelOnSeveralRanks,
                         ::testing::Values(2, 4),
                         testing::world_size_name);

}  // namespace
}  // namespace torch_mp::tp_testing
