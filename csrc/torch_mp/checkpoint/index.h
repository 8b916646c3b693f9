#pragma once
// A checkpoint's index.json, written last by a save (so that a directory without one is an
// unfinished save):
//
//   {
//    "format": "torch_mp checkpoint",
//    "version": 3,
//    "files": ["shard-0-0.safetensors", "shard-0-1.safetensors"],
//    "metadata": {
//     "step": "100"
//    },
//    "checksums": {
//     "extra.pt": "1a2b3c4d"
//    },
//    "header_checksums": {
//     "shard-0-0.safetensors": "5e6f7a8b", "shard-0-1.safetensors": "9c0d1e2f"
//    },
//    "index_crc32c": "3a4b5c6d"
//   }
//
// "checksums" holds the CRC-32C (checksum.h) of the other files a save writes beside the shard
// files (whose tensors carry their own), "header_checksums" that of each shard file's header
// (safetensors_header.h: header_checksum; it records the tensors' checksums in turn), and
// "index_crc32c" that of the index's content without it (json_text of the parsed object: the
// same however a tool re-spaced the file). In version 3 all three are mandatory, every file the
// index names has its checksum, and every name is a plain file name inside the checkpoint
// directory; version 2 (written before) is still read, its checksums optional, and counts as
// unchecked.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torch_mp::checkpoint {

/// The index's "format".
inline constexpr const char* kFormat = "torch_mp checkpoint";
/// The index's "version": what this torch_mp writes (it reads this and kOldestVersion).
inline constexpr int64_t kVersion = 3;
/// The oldest version this torch_mp reads: 2, whose checksums are optional.
inline constexpr int64_t kOldestVersion = 2;
/// The index's file name in a checkpoint directory.
inline constexpr const char* kIndex = "index.json";

/// What an index lists: the checkpoint's shard files and the metadata given to save.
struct Index {
  /// The format version read (kVersion for an index written now).
  int64_t version = kVersion;
  /// The shard files, relative to the checkpoint directory.
  std::vector<std::string> files;
  /// The metadata given to save.
  std::map<std::string, std::string> metadata;
  /// The CRC-32C of each root file (name -> crc), none in an index written without them.
  std::map<std::string, uint32_t> checksums;
  /// The CRC-32C of each shard file's header (name -> crc), likewise.
  std::map<std::string, uint32_t> header_checksums;
};

/// The text of the index listing `index.files`, `index.metadata` and the checksums, its own
/// CRC-32C last.
std::string index_text(const Index& index);

/// Reads `text`, the index `index_path`: JSON (json.h), its fields of their types, no key
/// twice, every name a plain file name (plain_name_problem), its own checksum matching and, in
/// version 3, every checksum present. Raises, naming the file and what is wrong, otherwise.
Index parse_index(std::string_view text, const std::string& index_path);

/// Reads the index of the checkpoint directory `directory` (parse_index), and checks that each
/// file it names that exists is a regular file, not a link. Raises, naming it, if it has none
/// (the save that wrote it did not finish) or parse_index refuses it.
Index read_index(const std::string& directory);

/// What is wrong with `name` as the name of a file an index lists: not a plain file name
/// inside the checkpoint directory (empty, ".", "..", a '/' or '\\' in it, a NUL). nullopt
/// when it is one.
std::optional<std::string> plain_name_problem(const std::string& name);

/// What is wrong with the shard file `name` of the checkpoint `directory`: its header's CRC-32C
/// is not the one `index` records (a damaged header, or a file from another save). nullopt
/// when it matches, or a version-2 index records none.
std::optional<std::string> header_problem(const Index& index,
                                          const std::string& directory,
                                          const std::string& name);

/// What is wrong with `contents`, read from the root file `name` of the checkpoint
/// `directory`: its CRC-32C is not the one `index` records, or a version-3 index records none
/// (a file from elsewhere is never read unchecked). nullopt when it matches, or a version-2
/// index records none.
std::optional<std::string> root_file_problem(const Index& index,
                                             const std::string& directory,
                                             const std::string& name,
                                             const std::string& contents);

}  // namespace torch_mp::checkpoint
