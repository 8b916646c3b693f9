#pragma once
// The checkpoint format, below modules and optimizers: tensors named as in the dense model, each
// rank writing its own parts of them, read back into any other cut.
//
// A checkpoint is a directory:
//
//   index.json                  written last: the format, the list of shard files, metadata
//   shard-<pp>-<tp>.safetensors one per rank of data rank 0: its parts of the tensors it holds
//
// A tensor sharded along a dim is stored as the blocks of the dense tensor that this rank holds,
// each under "<name>@<dim>:<first dense index>" (a fused Q/K/V weight as three blocks, a padded
// vocabulary without its padding); a whole tensor under its name, written by one rank of the
// group it is replicated over. Each file's metadata gives every name's dense shape. Loading
// reads only the blocks that overlap what this rank holds, so any (tp, pp, dp) can read what
// any other wrote, and a dense safetensors file loads the same way (each tensor one block).

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <exception>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/checkpoint/safetensors.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// One tensor of this rank's share of a model (a parameter, buffer or optimizer state), and
/// where it lies in the dense tensor of its name.
struct Shard {
  /// The dense model's name, with a kind prefix: "model/<name>" or "optim/<name>/<state>".
  std::string name;
  /// This rank's tensor: read when saving, written in place when loading.
  at::Tensor tensor;
  /// The dense dim it is a part of; nullopt: it is the whole tensor.
  std::optional<int64_t> dim = std::nullopt;
  /// Parts of `dim`, each split over the ranks on its own (3 for a fused Q/K/V weight).
  int64_t parts = 1;
  /// The dense size along `dim`; nullopt: the parts tile it exactly (no padding).
  std::optional<int64_t> dense_size = std::nullopt;
  /// This rank's place in the group the tensor is sharded or replicated over.
  int64_t rank = 0;
  int64_t ranks = 1;

  /// Rows [local_begin, local_begin + length) of `tensor` along `dim` are the dense tensor's
  /// rows [dense_begin, dense_begin + length).
  struct Block {
    int64_t local_begin = 0;
    int64_t dense_begin = 0;
    int64_t length = 0;
  };
  /// Every block of this rank's tensor (none of its padding); one whole block when not sharded.
  std::vector<Block> blocks() const;
  /// The dense tensor's shape.
  std::vector<int64_t> dense_shape() const;
};

/// A Shard named `name` of `tensor`, laid out as the layout recorded for `parameter` (itself, or
/// the parameter an optimizer state tensor belongs to; see torch_mp/layout.h): whole, replicated
/// over `default_group` (the tensor-parallel group), when none is recorded.
Shard shard_of(std::string name,
               const at::Tensor& tensor,
               const at::Tensor& parameter,
               const GroupPtr& default_group);

/// The file name of the pipeline rank `pp`'s tensor rank `tp` in a checkpoint.
std::string shard_file(int64_t pp, int64_t tp);

/// Writes the checkpoint directory `path`: this rank's `shards` into `file` (none when nullopt:
/// a data-parallel replica), then, on rank 0 of `group`, `root_files` (name -> contents) and
/// `index.json` listing `files` (every shard file the checkpoint has) with `metadata`.
/// Collective over `group` (every rank that holds the model).
///
/// Crash-safe: everything is written into a directory beside `path`, which replaces `path` (an
/// earlier checkpoint is set aside first and removed last) only once every rank has written its
/// file; at every moment `path`, or the earlier checkpoint set aside, is complete. A failure on
/// any rank raises on every rank, naming it, and leaves `path` as it was.
void save(const std::string& path,
          const std::vector<Shard>& shards,
          const std::optional<std::string>& file,
          const std::vector<std::string>& files,
          const std::map<std::string, std::string>& metadata,
          const std::map<std::string, std::string>& root_files,
          const GroupPtr& group);

/// Runs `body`, turning an exception into one of `problems` (which raise_anywhere then reports
/// on every rank: a rank that raised alone would leave the others waiting).
template <typename Body>
void collect_problems(std::vector<std::string>& problems, const Body& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    problems.push_back(e.what_without_backtrace());
  } catch (const std::exception& e) {
    problems.push_back(e.what());
  }
}

/// Raises on every rank of `group` (this rank only when `group` is null) if any rank has
/// `problems`: "<what> on rank <r>: <its problems>", this rank's own if it has any.
void raise_anywhere(const std::vector<std::string>& problems,
                    const std::string& what,
                    const GroupPtr& group);

/// A checkpoint opened for reading.
class Reader {
 public:
  /// Opens the checkpoint directory `path` (or the earlier checkpoint a save killed between
  /// its two renames set aside), or the dense safetensors file `path`, whose tensors are then
  /// read as "<dense_prefix><key>". Collective over `group` (may be null): a checkpoint that
  /// is incomplete (no index.json: its save did not finish), lacks a file, or is not one, is
  /// refused on every rank, naming what is wrong.
  Reader(const std::string& path,
         const GroupPtr& group,
         const std::string& dense_prefix = "model/");

  struct Tensor {
    at::ScalarType dtype;
    std::vector<int64_t> shape;  // the dense shape
  };
  /// Every tensor of the checkpoint by dense name.
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  /// The metadata given to save (empty for a dense file).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The directory or file read.
  const std::string& path() const { return path_; }

  /// Fills every shard's tensor with its part of the checkpoint's tensor of its name (padding
  /// rows with zeros). Collective over `group`: if any rank's shard is missing, has another
  /// dense shape or is not covered, every rank raises, naming them, before anything changes.
  void load(const std::vector<Shard>& shards, const GroupPtr& group) const;

 private:
  struct Piece {
    size_t file;
    std::string key;
    std::optional<int64_t> dim;
    int64_t start = 0;
    int64_t length = 0;
  };
  std::vector<std::string> problems(const Shard& shard) const;
  void keep_one_copy(const std::string& name, std::vector<Piece>& pieces) const;

  std::string path_;
  std::vector<std::pair<std::string, Header>> files_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::vector<Piece>> pieces_;
  std::map<std::string, std::string> metadata_;
};

/// Writes the checkpoint (directory or dense file) `source` as one dense safetensors file at
/// `path` (keys without `prefix`; only names starting with it), for the dense model's
/// load_state_dict. Not collective: one process reads every file.
void consolidate(const std::string& source, const std::string& path, const std::string& prefix);

}  // namespace torch_mp::checkpoint
