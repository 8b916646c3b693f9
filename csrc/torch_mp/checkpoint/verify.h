#pragma once
// Checking a whole checkpoint against its checksums without loading it into a model: every
// block of every shard file, every root file (extra.pt), the index; the files in parallel.
//
//   const auto report = torch_mp::checkpoint::verify("ckpt/step_100");
//   for (const auto& bad : report.corrupt) std::cerr << bad.message << "\n";

#include <cstdint>
#include <string>
#include <vector>

namespace torch_mp::checkpoint {

/// A part of a checkpoint that fails its check.
struct CorruptBlock {
  /// The file, relative to the checkpoint directory (a dense file: its path).
  std::string file;
  /// The tensor's key in the file ("<name>@<dim>:<first index>" for a block of a sharded
  /// tensor); empty when the file as a whole is bad (missing, unreadable header, a root file).
  std::string key;
  /// The dense name of the tensor the block belongs to (empty as for `key`).
  std::string tensor;
  /// What is wrong, naming the file and the tensor.
  std::string message;
};

/// What verify found.
struct VerifyReport {
  /// Every block or file that fails its check, in file order.
  std::vector<CorruptBlock> corrupt;
  /// Files that record no checksums (written before torch_mp recorded them, or by another
  /// program): they were read, but could not be verified.
  std::vector<std::string> unchecked;
  /// Files, tensor blocks and bytes checked.
  int64_t files = 0;
  int64_t blocks = 0;
  int64_t bytes = 0;
};

/// Reads every file of the checkpoint directory (or dense safetensors file) `path` and checks
/// every block against its checksum, `threads` files at a time (0: one per core). Not
/// collective. Raises only if `path` is neither a checkpoint nor a file; everything else it
/// finds is reported.
VerifyReport verify(const std::string& path, int64_t threads = 0);

}  // namespace torch_mp::checkpoint
