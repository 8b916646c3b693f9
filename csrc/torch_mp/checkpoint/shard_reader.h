#pragma once
// Reading a checkpoint into any cut of the model: each rank reads only the saved blocks that
// overlap what it holds (shard_geometry.h), so any (tp, pp, dp) can read what any other wrote,
// and a dense safetensors file reads the same way (each tensor one block).

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_mp/checkpoint/index.h"
#include "torch_mp/checkpoint/safetensors.h"
#include "torch_mp/checkpoint/shard_geometry.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// A checkpoint opened for reading.
class Reader {
 public:
  /// Opens the checkpoint directory `path` (or the earlier checkpoint a save killed between
  /// its two renames set aside), or the dense safetensors file `path`, whose tensors are then
  /// read as "<dense_prefix><key>". Collective over `group` (may be null): a checkpoint that
  /// is incomplete (no index.json: its save did not finish), lacks a file, or is not one, is
  /// refused on every rank, naming what is wrong. A background save of this rank still running
  /// (async_save.h) is waited for first.
  Reader(const std::string& path,
         const GroupPtr& group,
         const std::string& dense_prefix = "model/");

  /// A tensor of the checkpoint: its dtype and its dense shape.
  struct Tensor {
    /// Its dtype as saved.
    at::ScalarType dtype;
    /// Its dense shape.
    std::vector<int64_t> shape;
  };
  /// Every tensor of the checkpoint by dense name.
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  /// The metadata given to save (empty for a dense file).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The directory or file read.
  const std::string& path() const { return path_; }
  /// What cannot be verified: the files that record no checksums (written before torch_mp
  /// recorded them, or by another program) and, for a checkpoint of format version 2, its
  /// index (whose checksums are optional).
  std::vector<std::string> unchecked_files() const;
  /// The contents of the root file `name` (as save's root_files, e.g. "extra.pt"), checked
  /// against the checksum the index records for it; nullopt if the checkpoint has no such
  /// file. Raises, naming it, if it is corrupt, is not a regular file, or (format version 3)
  /// the index records no checksum of it.
  std::optional<std::string> root_file(const std::string& name) const;

  /// Fills every shard's tensor with its part of the checkpoint's tensor of its name (padding
  /// rows with zeros), each block read checked against its checksum. Collective over `group`: if
  /// any rank's shard is missing, has another dense shape or is not covered, every rank raises,
  /// naming them, before anything changes.
  void load(const std::vector<Shard>& shards, const GroupPtr& group) const;

 private:
  // A saved block (or whole tensor): its file (index in files_) and key, and where it lies in
  // the dense tensor along `dim` (nullopt: the whole tensor).
  struct Piece {
    size_t file;
    std::string key;
    std::optional<int64_t> dim;
    int64_t start = 0;
    int64_t length = 0;
  };
  // One overlap of a shard's block with a saved piece: the part of the shard's tensor it fills.
  struct Overlap {
    const Shard* shard;
    at::Tensor destination;
    const Piece* piece;
    Box from, part;
  };
  // Reads the index of the checkpoint directory `path` and the headers of its files.
  void open_directory(const std::string& path);
  // Records the tensor `key` of files_[file]; `dense_prefix` is given for a dense file.
  void add_piece(size_t file,
                 const std::string& key,
                 const TensorEntry& entry,
                 const std::optional<std::string>& dense_prefix);
  void keep_one_copy(const std::string& name, std::vector<Piece>& pieces) const;
  std::vector<std::string> problems(const Shard& shard) const;
  std::vector<Overlap> overlaps_of(const std::vector<Shard>& shards) const;
  // Reads into `overlap`'s destination: straight into place when it can, otherwise through the
  // saved tensor, read once into `buffers` (by file and key).
  void fill(const Overlap& overlap,
            std::map<std::pair<size_t, std::string>, at::Tensor>& buffers) const;

  std::string path_;
  std::vector<std::pair<std::string, Header>> files_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::vector<Piece>> pieces_;
  std::map<std::string, std::string> metadata_;
  Index index_;  // a directory's (empty for a dense file)
};

/// Writes the checkpoint (directory or dense file) `source` as one dense safetensors file at
/// `path` (keys without `prefix`; only names starting with it), for the dense model's
/// load_state_dict, with `metadata` in its header beside format "torch_mp dense". Not
/// collective: one process reads every file.
void consolidate(const std::string& source,
                 const std::string& path,
                 const std::string& prefix,
                 const std::map<std::string, std::string>& metadata = {});

}  // namespace torch_mp::checkpoint
