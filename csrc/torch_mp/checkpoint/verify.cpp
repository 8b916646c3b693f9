// Checking a checkpoint against its checksums (verify.h).

#include "torch_mp/checkpoint/verify.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "torch_mp/agreement.h"
#include "torch_mp/checkpoint/atomic_files.h"
#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/index.h"
#include "torch_mp/checkpoint/safetensors.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

// One file to check: a shard file (or a dense file), or a root file, of the checkpoint with
// `index` in `directory` (empty for a dense file).
struct FileToCheck {
  std::string path;
  std::string name;  // as reported
  bool root = false;
};

// The dense name of the tensor stored under `key` ("<name>@<dim>:<start>" or "<name>").
std::string tensor_of(const std::string& key) { return key.substr(0, key.rfind('@')); }

void check_root_file(const FileToCheck& file,
                     const Index& index,
                     const std::string& directory,
                     VerifyReport& report) {
  std::ifstream in(file.path, std::ios::binary);
  const std::string contents{std::istreambuf_iterator<char>(in), {}};
  report.bytes += static_cast<int64_t>(contents.size());
  if (!in.good() && !in.eof()) {
    report.corrupt.push_back({file.name, "", "", file.path + ": cannot be read"});
  } else if (const auto problem = root_file_problem(index, directory, file.name, contents)) {
    report.corrupt.push_back({file.name, "", "", *problem});
  }
}

void check_shard_file(const FileToCheck& file,
                      const Index& index,
                      const std::string& directory,
                      VerifyReport& report) {
  if (!directory.empty()) {
    if (const auto problem = header_problem(index, directory, file.name)) {
      report.corrupt.push_back({file.name, "", "", *problem});
    }
  }
  const auto header = read_header(file.path);
  if (!header.checksummed()) {
    report.unchecked.push_back(file.name);
  }
  for (const auto& [key, entry] : header.tensors) {
    report.blocks += 1;
    report.bytes += static_cast<int64_t>(entry.end - entry.begin);
    try {
      load_tensors(file.path, header, {key});  // checks the checksum
    } catch (const std::exception& e) {
      report.corrupt.push_back({file.name, key, tensor_of(key), text_of(e)});
    }
  }
}

// The files of the checkpoint directory or dense file `path`; what is missing or unreadable
// among them goes to `report`. `index` and `directory` are set for a directory.
std::vector<FileToCheck> files_of(const std::string& path,
                                  Index& index,
                                  std::string& directory,
                                  VerifyReport& report) {
  if (fs::is_regular_file(path)) {
    return {{path, path, false}};
  }
  directory = checkpoint_directory(path);
  try {
    index = read_index(directory);
  } catch (const std::exception& e) {
    report.corrupt.push_back({kIndex, "", "", text_of(e)});
    return {};
  }
  if (index.version < 3) {
    report.unchecked.push_back(std::string(kIndex) + " (format version " +
                               std::to_string(index.version) + ": its checksums are optional)");
  }
  std::vector<FileToCheck> files;
  for (const auto& name : index.files) {
    files.push_back({(fs::path(directory) / name).string(), name, false});
  }
  for (const auto& [name, crc] : index.checksums) {
    files.push_back({(fs::path(directory) / name).string(), name, true});
  }
  std::vector<FileToCheck> present;
  for (auto& file : files) {
    if (fs::exists(file.path)) {
      present.push_back(std::move(file));
    } else {
      report.corrupt.push_back({file.name, "", "", directory + " lacks " + file.name});
    }
  }
  return present;
}

}  // namespace

VerifyReport verify(const std::string& path, int64_t threads) {
  TORCH_CHECK(fs::exists(path), "torch_mp::checkpoint::verify: no checkpoint at ", path);
  VerifyReport report;
  Index index;
  std::string directory;
  const auto files = files_of(path, index, directory, report);
  std::vector<VerifyReport> found(files.size());
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t f = next++; f < files.size(); f = next++) {
      found[f].files += 1;
      try {  // (nothing may escape a worker thread)
        if (files[f].root) {
          check_root_file(files[f], index, directory, found[f]);
        } else {
          check_shard_file(files[f], index, directory, found[f]);
        }
      } catch (const std::exception& e) {
        found[f].corrupt.push_back({files[f].name, "", "", text_of(e)});
      }
    }
  };
  const auto cores = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  const auto count =
      std::min<int64_t>(threads > 0 ? threads : cores, static_cast<int64_t>(files.size()));
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < count; ++t) {
    workers.emplace_back(work);
  }
  work();
  for (auto& worker : workers) {
    worker.join();
  }
  for (auto& part : found) {
    report.corrupt.insert(report.corrupt.end(), part.corrupt.begin(), part.corrupt.end());
    report.unchecked.insert(report.unchecked.end(), part.unchecked.begin(), part.unchecked.end());
    report.files += part.files;
    report.blocks += part.blocks;
    report.bytes += part.bytes;
  }
  return report;
}

}  // namespace torch_mp::checkpoint
