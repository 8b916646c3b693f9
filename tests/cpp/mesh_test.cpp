// The mesh: its rank arithmetic (MeshShape, no communication) and the groups make_mesh builds.

#include "torch_mp/mesh.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "tensor_checks.h"
#include "thread_world.h"
#include "torch_mp/collectives.h"

namespace torch_mp {
namespace {

using testing::error_of;
using testing::mentions;

using Groups = std::vector<std::vector<int64_t>>;

// ---- MeshShape -------------------------------------------------------------------------------

TEST(MeshShape, InfersDataParallelSizeFromWorldSize) {
  const MeshShape shape = MeshShape::infer(/*world_size=*/12, /*tp=*/2, /*pp=*/3);
  EXPECT_EQ(shape.tp, 2);
  EXPECT_EQ(shape.pp, 3);
  EXPECT_EQ(shape.dp, 2);
  EXPECT_EQ(shape.world_size(), 12);
}

TEST(MeshShape, AcceptsAnExplicitDataParallelSizeThatFits) {
  const MeshShape shape = MeshShape::infer(8, 2, 2, 2);
  EXPECT_EQ(shape.dp, 2);
}

TEST(MeshShape, RejectsWorldSizeNotDivisibleByTensorTimesPipeline) {
  const auto error = error_of([] { MeshShape::infer(6, 4, 1); });
  EXPECT_TRUE(mentions(error, "world size 6 is not divisible by tp * pp = 4 * 1"));
}

TEST(MeshShape, RejectsExplicitDataParallelSizeThatDoesNotMultiplyToWorldSize) {
  const auto error = error_of([] { MeshShape::infer(8, 2, 2, 3); });
  EXPECT_TRUE(mentions(error, "world size 8 is not tp * pp * dp = 2 * 2 * 3"));
}

TEST(MeshShape, RejectsNonPositiveSizes) {
  EXPECT_TRUE(mentions(error_of([] { MeshShape::infer(4, 0, 1); }), "must be positive"));
  EXPECT_TRUE(mentions(error_of([] { MeshShape::infer(4, 2, 1, 0); }), "must be positive"));
}

TEST(MeshShape, CoordFollowsTensorFastestThenDataThenPipeline) {
  const MeshShape shape = MeshShape::infer(24, 2, 3, 4);
  for (int64_t rank = 0; rank < 24; ++rank) {
    const MeshCoord c = shape.coord(rank);
    EXPECT_EQ((c.pp * shape.dp + c.dp) * shape.tp + c.tp, rank) << "rank " << rank;
    EXPECT_TRUE(c.tp >= 0 && c.tp < 2 && c.dp >= 0 && c.dp < 4 && c.pp >= 0 && c.pp < 3)
        << "rank " << rank;
  }
}

TEST(MeshShape, RankOfCoordRoundTrips) {
  for (const auto& [tp, pp] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {2, 1}, {2, 2}, {4, 2}}) {
    const MeshShape shape = MeshShape::infer(16, tp, pp);
    for (int64_t rank = 0; rank < 16; ++rank) {
      EXPECT_EQ(shape.rank(shape.coord(rank)), rank) << "tp " << tp << " pp " << pp;
    }
  }
}

TEST(MeshShape, CoordRejectsRankOutsideTheMesh) {
  const MeshShape shape = MeshShape::infer(4, 2, 1);
  EXPECT_TRUE(mentions(error_of([&] { shape.coord(4); }), "outside a mesh of 4 ranks"));
}

TEST(MeshShape, GroupsOfWorld8Tp2Pp2Dp2MatchTheLayoutInMeshH) {
  const MeshShape shape = MeshShape::infer(8, 2, 2);
  EXPECT_EQ(shape.groups(Axis::kTensor), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(shape.groups(Axis::kData), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(shape.groups(Axis::kPipeline), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(MeshShape, ContextSitsBetweenTensorAndData) {
  // world 16, tp 2, cp 2, dp 2, pp 2: rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
  const MeshShape shape = MeshShape::infer(16, 2, 2, std::nullopt, 2);
  EXPECT_EQ(shape.dp, 2);
  for (int64_t rank = 0; rank < 16; ++rank) {
    const MeshCoord c = shape.coord(rank);
    EXPECT_EQ(((c.pp * 2 + c.dp) * 2 + c.cp) * 2 + c.tp, rank) << "rank " << rank;
    EXPECT_EQ(shape.rank(c), rank);
  }
  EXPECT_EQ(shape.groups(Axis::kContext)[0], (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(shape.groups(Axis::kData)[0], (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(shape.data_context_groups()[0], (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(shape.embedding_groups()[1], (std::vector<int64_t>{1, 9}));
  EXPECT_TRUE(mentions(error_of([] { MeshShape::infer(8, 2, 1, std::nullopt, 3); }),
                       "is not divisible by tp * pp * cp = 2 * 1 * 3"));
}

TEST(MeshShape, ExpertGroupsAreBlocksOfTheDataContextRanks) {
  // world 16, tp 2, dp 2, cp 2, pp 2, ep 2: the data x context group of rank 0 is [0 2 4 6].
  const MeshShape shape = MeshShape::infer(16, 2, 2, std::nullopt, 2, 2);
  EXPECT_EQ(shape.expert_groups()[0], (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(shape.expert_groups()[1], (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(shape.expert_data_groups()[0], (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(shape.expert_data_groups()[1], (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(shape.ep_rank(4), 0);
  EXPECT_EQ(shape.ep_rank(6), 1);
  EXPECT_EQ(shape.ep_rank(7), 1);
  EXPECT_TRUE(mentions(error_of([] { MeshShape::infer(8, 2, 1, std::nullopt, 1, 3); }),
                       "ep (3) must divide dp (4)"));
  EXPECT_TRUE(mentions(error_of([] { MeshShape::infer(8, 2, 1, 2, 2, 8); }),
                       "ep (8) must divide dp * cp (4)"));
}

// ---- make_mesh -------------------------------------------------------------------------------

/// A mesh to build: world size and the tp, pp it is asked for (dp inferred).
struct MeshCase {
  int world;
  int64_t tp;
  int64_t pp;
};

/// Prints a MeshCase in gtest's messages (instead of its bytes).
void PrintTo(const MeshCase& c, std::ostream* os) {
  *os << "world " << c.world << ", tp " << c.tp << ", pp " << c.pp;
}

/// Names a MeshCase instance "world<W>_tp<T>_pp<P>".
std::string case_name(const ::testing::TestParamInfo<MeshCase>& info) {
  return "world" + std::to_string(info.param.world) + "_tp" + std::to_string(info.param.tp) +
         "_pp" + std::to_string(info.param.pp);
}

/// World ranks of the members of `group`, in group-rank order (an all-gather over the group).
std::vector<int64_t> member_world_ranks(const GroupPtr& group, int64_t world_rank) {
  const auto gathered = comm::all_gather(at::tensor({world_rank}, at::kLong), 0, group);
  return std::vector<int64_t>(gathered.data_ptr<int64_t>(),
                              gathered.data_ptr<int64_t>() + gathered.numel());
}

class MakeMesh : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MakeMesh, GroupsHoldTheRanksGivenByTheLayoutFormula) {
  const auto [world, tp, pp] = GetParam();
  const int64_t dp = world / (tp * pp);
  testing::run_on_mesh(world, testing::test_options(tp, pp), [&](const Mesh& mesh) {
    // rank = (pp_rank * dp + dp_rank) * tp + tp_rank, inverted by hand.
    const int64_t tp_rank = mesh.rank % tp;
    const int64_t dp_rank = (mesh.rank / tp) % dp;
    const int64_t pp_rank = mesh.rank / (tp * dp);
    const auto world_rank = [&](int64_t p, int64_t d, int64_t t) { return (p * dp + d) * tp + t; };
    std::vector<int64_t> tensor_ranks, data_ranks, pipeline_ranks;
    for (int64_t t = 0; t < tp; ++t) tensor_ranks.push_back(world_rank(pp_rank, dp_rank, t));
    for (int64_t d = 0; d < dp; ++d) data_ranks.push_back(world_rank(pp_rank, d, tp_rank));
    for (int64_t p = 0; p < pp; ++p) pipeline_ranks.push_back(world_rank(p, dp_rank, tp_rank));

    EXPECT_EQ(mesh.world->getSize(), world);
    EXPECT_EQ(mesh.world->getRank(), mesh.rank);
    EXPECT_EQ(mesh.tp_group->getSize(), tp);
    EXPECT_EQ(mesh.dp_group->getSize(), dp);
    EXPECT_EQ(mesh.pp_group->getSize(), pp);
    EXPECT_EQ(mesh.tp_group->getRank(), tp_rank);
    EXPECT_EQ(mesh.dp_group->getRank(), dp_rank);
    EXPECT_EQ(mesh.pp_group->getRank(), pp_rank);
    EXPECT_EQ(mesh.tp_rank(), tp_rank);
    EXPECT_EQ(mesh.dp_rank(), dp_rank);
    EXPECT_EQ(mesh.pp_rank(), pp_rank);
    EXPECT_EQ(member_world_ranks(mesh.tp_group, mesh.rank), tensor_ranks) << "rank " << mesh.rank;
    EXPECT_EQ(member_world_ranks(mesh.dp_group, mesh.rank), data_ranks) << "rank " << mesh.rank;
    EXPECT_EQ(member_world_ranks(mesh.pp_group, mesh.rank), pipeline_ranks) << "rank " << mesh.rank;
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts,
                         MakeMesh,
                         ::testing::Values(MeshCase{1, 1, 1},
                                           MeshCase{2, 2, 1},
                                           MeshCase{2, 1, 2},
                                           MeshCase{2, 1, 1},
                                           MeshCase{4, 2, 1},
                                           MeshCase{4, 2, 2},
                                           MeshCase{4, 1, 2},
                                           MeshCase{4, 4, 1}),
                         case_name);

class MakeMeshMismatch : public ::testing::TestWithParam<int> {};

TEST_P(MakeMeshMismatch, OptionsThatDifferBetweenRanksRaiseOnEveryRank) {
  const int world = GetParam();
  // Rank 0 asks for tp=2, the others for tp=1: both shapes fit the world, only the check can tell.
  const auto errors = testing::run_on_mesh_collecting_errors(
      world, [](int rank) { return testing::test_options(rank == 0 ? 2 : 1); }, [](const Mesh&) {});
  testing::expect_every_rank_raised(errors, "must be the same on every rank");
  testing::expect_every_rank_raised(errors, "rank 0 has [2, 1,");
}

TEST_P(MakeMeshMismatch, AnOptionInvalidOnOneRankRaisesOnEveryRankWithoutWaiting) {
  const int world = GetParam();
  // tp=3 fits no world here: rank 0 alone would fail, and the others must not wait for it.
  const auto start = std::chrono::steady_clock::now();
  const auto errors = testing::run_on_mesh_collecting_errors(
      world, [](int rank) { return testing::test_options(rank == 0 ? 3 : 1); }, [](const Mesh&) {});
  testing::expect_every_rank_raised(errors, "must be the same on every rank");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes,
                         MakeMeshMismatch,
                         ::testing::Values(2, 4),
                         testing::world_size_name);

// ---- NCCL groups from C++ (run where a GPU is; what can be checked without one, otherwise) ----

TEST(NcclGroup, OneRankAllReducesOnItsDeviceOrSaysWhyItCannot) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  if (!nccl_available()) {
    EXPECT_TRUE(mentions(error_of([&] {
                           new_process_group(
                               store, 0, 1, Backend::kNccl, std::chrono::seconds(20), "nccl");
                         }),
                         "built without NCCL"));
    GTEST_SKIP() << "this build has no NCCL (a CPU build of torch, or nccl.h not found)";
  }
  if (!at::hasCUDA() || at::detail::getCUDAHooks().deviceCount() == 0) {
    EXPECT_TRUE(mentions(error_of([] { use_local_cuda_device(0); }), "sees none"));
    GTEST_SKIP() << "needs a CUDA device (the build has NCCL; nothing to run it on here)";
  }
  use_local_cuda_device(0);
  const auto group =
      new_process_group(store, 0, 1, Backend::kNccl, std::chrono::seconds(20), "nccl");
  const auto x = at::arange(6, at::TensorOptions(at::kFloat).device(at::kCUDA));
  EXPECT_TRUE(comm::all_reduce(x, group).cpu().equal(x.cpu()));
  const auto cpu = at::ones({3});  // CPU tensors go over Gloo on the same group
  EXPECT_TRUE(comm::all_reduce(cpu, group).equal(cpu));
}

}  // namespace
}  // namespace torch_mp
