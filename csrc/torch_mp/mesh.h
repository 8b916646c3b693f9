#pragma once
// The data x pipeline x tensor (x context, expert) process-group mesh.
//
// Ranks are laid out tensor fastest, then context, then data, then pipeline, so that a tensor
// group, then a context group, sits inside one node:
//
//   rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
//
// With cp = 1 (no context parallelism) that is (pp_rank * dp + dp_rank) * tp + tp_rank:
//
//   world 8, tp 2, pp 2, dp 2:      tensor groups    [0 1] [2 3] [4 5] [6 7]
//     pp_rank 0: dp 0 -> 0 1        data groups      [0 2] [1 3] [4 6] [5 7]
//                dp 1 -> 2 3        pipeline groups  [0 4] [1 5] [2 6] [3 7]
//     pp_rank 1: dp 0 -> 4 5
//                dp 1 -> 6 7
//
// Expert parallelism (moe/) is carved out of the data x context ranks of each pipeline and
// tensor coordinate, in their order (data rank major, context rank minor): the expert groups are
// blocks of ep consecutive ones, each holding every expert once between them; the expert-data
// groups are the ranks at the same place in every block, which hold the same experts.
//
//   world 8, dp 8, ep 2:            expert groups    [0 1] [2 3] [4 5] [6 7]
//                                   expert-data      [0 2 4 6] [1 3 5 7]

#include <torch/arg.h>

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp {

/// One axis of the mesh.
enum class Axis { kTensor, kData, kPipeline, kContext };

/// A rank's place on the mesh.
struct MeshCoord {
  int64_t pp = 0;
  int64_t dp = 0;
  int64_t tp = 0;
  int64_t cp = 0;
};

/// The sizes of the four axes and the rank arithmetic over them (no communication).
struct MeshShape {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t dp = 1;
  int64_t cp = 1;
  /// Expert-parallel size: divides dp * cp (no rank arithmetic of its own; see the top).
  int64_t ep = 1;

  /// The shape for `world_size` ranks; `dp` defaults to world_size / (tp * pp * cp).
  /// Raises if a size is not positive, tp * pp * dp * cp != world_size, or ep does not divide
  /// dp * cp.
  static MeshShape infer(int64_t world_size,
                         int64_t tp,
                         int64_t pp,
                         std::optional<int64_t> dp = std::nullopt,
                         int64_t cp = 1,
                         int64_t ep = 1);

  int64_t world_size() const { return tp * pp * dp * cp; }
  /// Coordinates of world rank `rank`.
  MeshCoord coord(int64_t rank) const;
  /// World rank at `coord`.
  int64_t rank(const MeshCoord& coord) const;
  /// Size of one axis.
  int64_t size(Axis axis) const;
  /// Every group along `axis`, each as its world ranks in group-rank order. Groups are listed in
  /// one fixed order, the same on every rank.
  std::vector<std::vector<int64_t>> groups(Axis axis) const;
  /// The embedding groups: the ranks of the first and the last pipeline stage with the same data,
  /// context and tensor coordinates (one rank when pp = 1), where a tied embedding/head is summed.
  std::vector<std::vector<int64_t>> embedding_groups() const;
  /// The data x context groups: the ranks with the same pipeline and tensor coordinates, over
  /// which the gradients of parameters replicated over the context group are reduced (the data
  /// groups when cp = 1).
  std::vector<std::vector<int64_t>> data_context_groups() const;
  /// The expert groups: blocks of ep consecutive ranks of each data x context group.
  std::vector<std::vector<int64_t>> expert_groups() const;
  /// The expert-data groups: the ranks at the same place in each block of a data x context
  /// group, which hold the same experts (their gradients are reduced over them).
  std::vector<std::vector<int64_t>> expert_data_groups() const;
  /// This rank's place in its expert group.
  int64_t ep_rank(int64_t rank) const;
};

/// Options for `init` and `make_mesh`.
struct InitOptions {
  /// Tensor-parallel size.
  TORCH_ARG(int64_t, tp) = 1;
  /// Pipeline-parallel size.
  TORCH_ARG(int64_t, pp) = 1;
  /// Data-parallel size; inferred from the world size when unset.
  TORCH_ARG(std::optional<int64_t>, dp) = std::nullopt;
  /// Context-parallel size: ranks that split each sequence between them (context_parallel/).
  TORCH_ARG(int64_t, cp) = 1;
  /// Expert-parallel size: ranks that split a mixture of experts' experts between them (moe/);
  /// divides dp * cp.
  TORCH_ARG(int64_t, ep) = 1;
  /// Backend; Gloo when unset (creating NCCL groups from C++ is not built yet).
  TORCH_ARG(std::optional<Backend>, backend) = std::nullopt;
  /// Timeout of every collective on the mesh's groups.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
};

/// The process groups of one rank: the world and the four axes through it.
struct Mesh {
  MeshShape shape;
  int64_t rank = 0;
  GroupPtr world;
  GroupPtr tp_group;
  GroupPtr dp_group;
  GroupPtr pp_group;
  /// The ranks that split a sequence with this one (context_parallel/).
  GroupPtr cp_group;
  /// The data x context ranks of this rank's pipeline and tensor coordinates (dp_group when
  /// cp = 1): where gradients of parameters replicated over the context group are reduced.
  GroupPtr dp_cp_group;
  /// The ranks that split a mixture of experts' experts with this one (moe/); one rank when
  /// ep = 1.
  GroupPtr ep_group;
  /// The ranks that hold the same experts as this one, over which expert gradients are reduced
  /// (dp_cp_group when ep = 1).
  GroupPtr expert_dp_group;
  /// The first and last pipeline stages' ranks of this rank's data and tensor coordinates (see
  /// MeshShape::embedding_groups); null on ranks of the stages in between.
  GroupPtr embedding_group;
  /// The store the groups were made over (fresh groups, e.g. Pipeline::reset, use it too).
  StorePtr store;

  int64_t tp_rank() const { return shape.coord(rank).tp; }
  int64_t dp_rank() const { return shape.coord(rank).dp; }
  int64_t pp_rank() const { return shape.coord(rank).pp; }
  int64_t cp_rank() const { return shape.coord(rank).cp; }
  int64_t tp_size() const { return shape.tp; }
  int64_t dp_size() const { return shape.dp; }
  int64_t pp_size() const { return shape.pp; }
  int64_t cp_size() const { return shape.cp; }
  int64_t ep_rank() const { return shape.ep_rank(rank); }
  int64_t ep_size() const { return shape.ep; }
};

/// Builds the mesh of rank `rank` among `world_size` ranks that share `store`. Every rank must
/// call it with the same options; a difference is detected and raised on every rank.
std::shared_ptr<Mesh> make_mesh(const StorePtr& store,
                                int64_t rank,
                                int64_t world_size,
                                const InitOptions& options = {});

/// Initialises torch_mp in a process launched by torchrun: reads MASTER_ADDR, MASTER_PORT, RANK
/// and WORLD_SIZE, connects a TCPStore, builds the mesh and makes it the default one.
std::shared_ptr<Mesh> init(const InitOptions& options = {});

/// The default mesh (set by `init` or `set_mesh`); raises if there is none.
std::shared_ptr<Mesh> get_mesh();

/// The default mesh, or null if there is none.
std::shared_ptr<Mesh> find_mesh();

/// Makes `mesh` the default mesh (nullptr clears it).
void set_mesh(std::shared_ptr<Mesh> mesh);

}  // namespace torch_mp
