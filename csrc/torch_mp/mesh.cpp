#include "torch_mp/mesh.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "torch_mp/collectives.h"
#include "torch_mp/errors.h"

namespace torch_mp {

MeshShape MeshShape::infer(
    int64_t world_size, int64_t tp, int64_t pp, std::optional<int64_t> dp, int64_t cp, int64_t ep) {
  TORCH_CHECK(world_size > 0, "torch_mp.init: world size must be positive, got ", world_size);
  TORCH_CHECK(
      tp > 0 && pp > 0, "torch_mp.init: tp and pp must be positive, got tp=", tp, ", pp=", pp);
  TORCH_CHECK(cp > 0, "torch_mp.init: cp must be positive, got cp=", cp);
  TORCH_CHECK(!dp || *dp > 0, "torch_mp.init: dp must be positive, got dp=", *dp);
  const std::string product = cp == 1 ? "tp * pp" : "tp * pp * cp";
  const std::string factors =
      std::to_string(tp) + " * " + std::to_string(pp) + (cp == 1 ? "" : " * " + std::to_string(cp));
  if (!dp) {
    TORCH_MP_CHECK_LAYOUT(world_size % (tp * pp * cp) == 0,
                          "torch_mp.init: world size ",
                          world_size,
                          " is not divisible by ",
                          product,
                          " = ",
                          factors);
    dp = world_size / (tp * pp * cp);
  }
  TORCH_MP_CHECK_LAYOUT(tp * pp * *dp * cp == world_size,
                        "torch_mp.init: world size ",
                        world_size,
                        " is not ",
                        product,
                        " * dp = ",
                        factors,
                        " * ",
                        *dp);
  TORCH_CHECK(ep > 0 && (*dp * cp) % ep == 0,
              "torch_mp.init: ep (",
              ep,
              ") must divide ",
              cp == 1 ? "dp (" : "dp * cp (",
              *dp * cp,
              ")");
  return MeshShape{tp, pp, *dp, cp, ep};
}

MeshCoord MeshShape::coord(int64_t rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_size(),
              "torch_mp: rank ",
              rank,
              " is outside a mesh of ",
              world_size(),
              " ranks");
  const int64_t outer = rank / (tp * cp);  // pp_rank * dp + dp_rank
  return MeshCoord{outer / dp, outer % dp, rank % tp, (rank / tp) % cp};
}

int64_t MeshShape::rank(const MeshCoord& c) const {
  return ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp;
}

int64_t MeshShape::size(Axis axis) const {
  switch (axis) {
    case Axis::kTensor:
      return tp;
    case Axis::kData:
      return dp;
    case Axis::kPipeline:
      return pp;
    case Axis::kContext:
      return cp;
  }
  return 0;
}

namespace {

int64_t& coordinate(MeshCoord& c, Axis axis) {
  switch (axis) {
    case Axis::kTensor:
      return c.tp;
    case Axis::kData:
      return c.dp;
    case Axis::kPipeline:
      return c.pp;
    case Axis::kContext:
      return c.cp;
  }
  return c.tp;
}

}  // namespace

std::vector<std::vector<int64_t>> MeshShape::groups(Axis axis) const {
  // A group is every rank whose other coordinates match; list groups by their first rank.
  std::vector<std::vector<int64_t>> result;
  for (int64_t first = 0; first < world_size(); ++first) {
    MeshCoord c = coord(first);
    if (coordinate(c, axis) != 0) {
      continue;
    }
    std::vector<int64_t> ranks;
    for (int64_t i = 0; i < size(axis); ++i) {
      MeshCoord member = c;
      coordinate(member, axis) = i;
      ranks.push_back(rank(member));
    }
    result.push_back(std::move(ranks));
  }
  return result;
}

std::vector<std::vector<int64_t>> MeshShape::data_context_groups() const {
  std::vector<std::vector<int64_t>> result;
  for (int64_t p = 0; p < pp; ++p) {
    for (int64_t t = 0; t < tp; ++t) {
      std::vector<int64_t> ranks;
      for (int64_t d = 0; d < dp; ++d) {
        for (int64_t c = 0; c < cp; ++c) {
          ranks.push_back(rank({p, d, t, c}));
        }
      }
      result.push_back(std::move(ranks));
    }
  }
  return result;
}

std::vector<std::vector<int64_t>> MeshShape::expert_groups() const {
  std::vector<std::vector<int64_t>> result;
  for (const auto& group : data_context_groups()) {
    for (size_t first = 0; first < group.size(); first += ep) {
      result.emplace_back(group.begin() + first, group.begin() + first + ep);
    }
  }
  return result;
}

std::vector<std::vector<int64_t>> MeshShape::expert_data_groups() const {
  std::vector<std::vector<int64_t>> result;
  for (const auto& group : data_context_groups()) {
    for (int64_t place = 0; place < ep; ++place) {
      std::vector<int64_t> ranks;
      for (size_t i = place; i < group.size(); i += ep) {
        ranks.push_back(group[i]);
      }
      result.push_back(std::move(ranks));
    }
  }
  return result;
}

int64_t MeshShape::ep_rank(int64_t rank) const {
  const MeshCoord c = coord(rank);
  return (c.dp * cp + c.cp) % ep;
}

std::vector<std::vector<int64_t>> MeshShape::embedding_groups() const {
  std::vector<std::vector<int64_t>> result;
  for (int64_t d = 0; d < dp; ++d) {
    for (int64_t c = 0; c < cp; ++c) {
      for (int64_t t = 0; t < tp; ++t) {
        std::vector<int64_t> ranks{rank({0, d, t, c})};
        if (pp > 1) {
          ranks.push_back(rank({pp - 1, d, t, c}));
        }
        result.push_back(std::move(ranks));
      }
    }
  }
  return result;
}

namespace {

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kTensor:
      return "tp";
    case Axis::kData:
      return "dp";
    case Axis::kPipeline:
      return "pp";
    case Axis::kContext:
      return "cp";
  }
  return "?";
}

// Creates this rank's group among `groups` (null if it is in none); each group rendezvouses
// under its own store prefix.
GroupPtr make_group(const StorePtr& store,
                    const std::vector<std::vector<int64_t>>& groups,
                    const std::string& label,
                    int64_t rank,
                    Backend backend,
                    std::chrono::milliseconds timeout) {
  for (size_t index = 0; index < groups.size(); ++index) {
    const auto& ranks = groups[index];
    const auto it = std::find(ranks.begin(), ranks.end(), rank);
    if (it == ranks.end()) {
      continue;
    }
    const std::string name = "torch_mp/" + label + "/" + std::to_string(index);
    return new_process_group(c10::make_intrusive<c10d::PrefixStore>(name, store),
                             static_cast<int>(it - ranks.begin()),
                             static_cast<int>(ranks.size()),
                             backend,
                             timeout,
                             name);
  }
  return {};
}

GroupPtr make_axis_group(const StorePtr& store,
                         const MeshShape& shape,
                         Axis axis,
                         int64_t rank,
                         Backend backend,
                         std::chrono::milliseconds timeout) {
  GroupPtr group = make_group(store, shape.groups(axis), axis_name(axis), rank, backend, timeout);
  TORCH_INTERNAL_ASSERT(group, "rank ", rank, " is in no ", axis_name(axis), " group");
  return group;
}

std::string env_or_throw(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value && *value,
              "torch_mp::init: environment variable ",
              name,
              " is not set; launch the program with torchrun (e.g. torchrun --no-python "
              "--nproc-per-node=2 ./program)");
  return value;
}

std::mutex default_mesh_mutex;
std::shared_ptr<Mesh> default_mesh;

}  // namespace

std::shared_ptr<Mesh> make_mesh(const StorePtr& store,
                                int64_t rank,
                                int64_t world_size,
                                const InitOptions& options) {
  auto mesh = std::make_shared<Mesh>();
  mesh->rank = rank;
  // Gloo unless NCCL is asked for (torch_mp::init then puts each rank on its local device).
  const Backend backend = options.backend().value_or(Backend::kGloo);
  mesh->store = store;
  mesh->world = new_process_group(c10::make_intrusive<c10d::PrefixStore>("torch_mp/world", store),
                                  static_cast<int>(rank),
                                  static_cast<int>(world_size),
                                  backend,
                                  options.timeout(),
                                  "torch_mp/world");
  // Agree on the request before acting on it: ranks that asked for different meshes all raise,
  // instead of some failing alone and the rest waiting for groups that never form.
  comm::check_same_across_ranks(
      {options.tp(), options.pp(), options.dp().value_or(-1), static_cast<int64_t>(backend)},
      mesh->world,
      "torch_mp::init options [tp, pp, dp, backend]");
  comm::check_same_across_ranks({options.cp()}, mesh->world, "torch_mp::init option cp");
  comm::check_same_across_ranks({options.ep()}, mesh->world, "torch_mp::init option ep");
  mesh->shape = MeshShape::infer(
      world_size, options.tp(), options.pp(), options.dp(), options.cp(), options.ep());
  mesh->tp_group =
      make_axis_group(store, mesh->shape, Axis::kTensor, rank, backend, options.timeout());
  mesh->dp_group =
      make_axis_group(store, mesh->shape, Axis::kData, rank, backend, options.timeout());
  mesh->pp_group =
      make_axis_group(store, mesh->shape, Axis::kPipeline, rank, backend, options.timeout());
  mesh->cp_group =
      make_axis_group(store, mesh->shape, Axis::kContext, rank, backend, options.timeout());
  mesh->dp_cp_group = mesh->shape.cp == 1 ? mesh->dp_group
                                          : make_group(store,
                                                       mesh->shape.data_context_groups(),
                                                       "dp_cp",
                                                       rank,
                                                       backend,
                                                       options.timeout());
  mesh->ep_group =
      make_group(store, mesh->shape.expert_groups(), "ep", rank, backend, options.timeout());
  mesh->expert_dp_group = mesh->shape.ep == 1 ? mesh->dp_cp_group
                                              : make_group(store,
                                                           mesh->shape.expert_data_groups(),
                                                           "expert_dp",
                                                           rank,
                                                           backend,
                                                           options.timeout());
  mesh->embedding_group = make_group(
      store, mesh->shape.embedding_groups(), "embedding", rank, backend, options.timeout());
  return mesh;
}

std::shared_ptr<Mesh> init(const InitOptions& options) {
  const std::string host = env_or_throw("MASTER_ADDR");
  const int port = std::stoi(env_or_throw("MASTER_PORT"));
  const int64_t rank = std::stoll(env_or_throw("RANK"));
  const int64_t world_size = std::stoll(env_or_throw("WORLD_SIZE"));
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = rank == 0;
  store_options.numWorkers = static_cast<size_t>(world_size);
  store_options.timeout = options.timeout();
  // Under torchrun the agent already serves the store on MASTER_PORT and says so in
  // TORCHELASTIC_USE_AGENT_STORE; every rank is then a client. Otherwise rank 0 serves it.
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
      agent && std::string(agent) == "True") {
    store_options.isServer = false;
  }
  auto store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  if (options.backend() == Backend::kNccl) {  // each rank on its local device
    const char* local_rank = std::getenv("LOCAL_RANK");
    use_local_cuda_device(local_rank ? std::stoi(local_rank) : static_cast<int>(rank));
  }
  auto mesh = make_mesh(store, rank, world_size, options);
  set_mesh(mesh);
  return mesh;
}

std::shared_ptr<Mesh> get_mesh() {
  std::lock_guard<std::mutex> lock(default_mesh_mutex);
  TORCH_CHECK(default_mesh, "torch_mp: there is no default mesh; call torch_mp::init() first");
  return default_mesh;
}

std::shared_ptr<Mesh> find_mesh() {
  std::lock_guard<std::mutex> lock(default_mesh_mutex);
  return default_mesh;
}

void set_mesh(std::shared_ptr<Mesh> mesh) {
  std::lock_guard<std::mutex> lock(default_mesh_mutex);
  default_mesh = std::move(mesh);
}

}  // namespace torch_mp
