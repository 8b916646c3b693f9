#pragma once
// Writing a checkpoint: each rank its shard file, then rank 0 the root files and the index, the
// whole published at once (atomic_files.h).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/checkpoint/shard_geometry.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// Whether this rank writes `shard` into its file: its blocks of a sharded tensor, or a whole
/// tensor when it is rank 0 of the group the tensor is replicated over.
inline bool writes(const Shard& shard) { return shard.dim.has_value() || shard.rank == 0; }

/// The file name of the pipeline rank `pp`'s tensor rank `tp` in a checkpoint; with
/// `expert_place` e > 0, of the file in which the data rank at place e of its data x context
/// group writes its mixture-of-experts tensors (the experts it holds, which no other rank of
/// that (pp, tp) writes).
std::string shard_file(int64_t pp, int64_t tp, int64_t expert_place = 0);

/// Where a rank of a layout sits, as a save plans its files.
struct SaveLayout {
  int64_t pp_size = 1, tp_size = 1, ep_size = 1, cp_size = 1;
  int64_t pp_rank = 0, tp_rank = 0, dp_rank = 0, cp_rank = 0;
  /// Its place in its data x context group (data rank major).
  int64_t place() const { return dp_rank * cp_size + cp_rank; }
};

/// What a rank's save writes.
struct SavePlan {
  /// This rank's file; none for a replica.
  std::optional<std::string> file;
  /// Every file of the checkpoint.
  std::vector<std::string> files;
  /// Which of the rank's shards go into its file (their indices, in order).
  std::vector<size_t> kept;
};

/// The save plan of a rank at `layout` whose shards lie, or not, over the expert group
/// (`over_experts`, one per shard): place 0 of each (pp, tp)'s data x context group writes
/// everything it holds; with ep > 1 places 1 .. ep - 1 (the other ranks of its expert group)
/// write their experts only, into files of their own; the other places are replicas and write
/// nothing.
SavePlan plan_save(const SaveLayout& layout, const std::vector<bool>& over_experts);

/// What a rank's save writes: its `shards` into `file` (none when nullopt: a data-parallel
/// replica), and, on rank 0 of the group, `root_files` (name -> contents) and `index.json`
/// listing `files` (every shard file the checkpoint has) with `metadata`.
struct SaveRequest {
  std::vector<Shard> shards;
  std::optional<std::string> file;
  std::vector<std::string> files;
  std::map<std::string, std::string> metadata;
  std::map<std::string, std::string> root_files;
};

/// Writes the checkpoint directory `path`: this rank's part of `request`, then, on rank 0 of
/// `group`, the root files and the index. Collective over `group` (every rank that holds the
/// model).
///
/// Crash-safe: everything is written into a directory beside `path`, which replaces `path` (an
/// earlier checkpoint is set aside first and removed last) only once every rank has written its
/// file; at every moment `path`, or the earlier checkpoint set aside, is complete. A failure on
/// any rank raises on every rank, naming it, and leaves `path` as it was. Every tensor block
/// and root file is written with its CRC-32C (checksum.h), which every read checks.
///
/// A background save of this process still running (async_save.h) is waited for first.
void save(const std::string& path, const SaveRequest& request, const GroupPtr& group);

/// save without waiting for a background save first: what async_save's thread runs.
void write_checkpoint(const std::string& path, const SaveRequest& request, const GroupPtr& group);

}  // namespace torch_mp::checkpoint
