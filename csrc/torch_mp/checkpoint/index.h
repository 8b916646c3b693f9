#pragma once
// A checkpoint's index.json, written last by a save (so that a directory without one is an
// unfinished save):
//
//   {
//    "format": "torch_mp checkpoint",
//    "version": 2,
//    "files": ["shard-0-0.safetensors", "shard-0-1.safetensors"],
//    "metadata": {
//     "step": "100"
//    }
//   }

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch_mp::checkpoint {

/// The index's "format".
inline constexpr const char* kFormat = "torch_mp checkpoint";
/// The index's "version": what this torch_mp writes and reads.
inline constexpr int64_t kVersion = 2;
/// The index's file name in a checkpoint directory.
inline constexpr const char* kIndex = "index.json";

/// What an index lists: the checkpoint's shard files and the metadata given to save.
struct Index {
  /// The shard files, relative to the checkpoint directory.
  std::vector<std::string> files;
  /// The metadata given to save.
  std::map<std::string, std::string> metadata;
};

/// The text of the index listing `index.files` and `index.metadata`.
std::string index_text(const Index& index);

/// Reads the index of the checkpoint directory `directory`. Raises, naming it, if it has none
/// (the save that wrote it did not finish), it is not JSON, of another format or version, or
/// lists no files.
Index read_index(const std::string& directory);

}  // namespace torch_mp::checkpoint
