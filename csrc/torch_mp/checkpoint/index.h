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
//    },
//    "checksums": {
//     "extra.pt": "1a2b3c4d"
//    }
//   }
//
// "checksums" holds the CRC-32C (checksum.h) of the other files a save writes beside the shard
// files (whose tensors carry their own); older indexes lack it.

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
  /// The CRC-32C of each root file (name -> crc), none in an index written without them.
  std::map<std::string, uint32_t> checksums;
};

/// The text of the index listing `index.files`, `index.metadata` and `index.checksums`.
std::string index_text(const Index& index);

/// Reads the index of the checkpoint directory `directory`. Raises, naming it, if it has none
/// (the save that wrote it did not finish), it is not JSON, of another format or version, or
/// lists no files.
Index read_index(const std::string& directory);

}  // namespace torch_mp::checkpoint
