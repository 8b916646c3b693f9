// Checking a checkpoint against its checksums (verify.h).

#include "torch_mp/checkpoint/verify.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "torch_mp/checkpoint/atomic_files.h"
#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/index.h"
#include "torch_mp/checkpoint/problems.h"
#include "torch_mp/checkpoint/safetensors.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

// One file to check: a shard file (or a dense file), or a root file with the checksum the
// index records.
struct FileToCheck {
  std::string path;
  std::string name;  // as reported
  std::optional<uint32_t> root_checksum;
};

std::string text_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

// The dense name of the tensor stored under `key` ("<name>@<dim>:<start>" or "<name>").
std::string tensor_of(const std::string& key) { return key.substr(0, key.rfind('@')); }

void check_root_file(const FileToCheck& file, VerifyReport& report) {
  std::ifstream in(file.path, std::ios::binary);
  const std::string contents{std::istreambuf_iterator<char>(in), {}};
  report.files += 1;
  report.bytes += static_cast<int64_t>(contents.size());
  const uint32_t actual = crc32c(contents.data(), contents.size());
  if (!in.good() && !in.eof()) {
    report.corrupt.push_back({file.name, "", "", file.path + ": cannot be read"});
  } else if (actual != *file.root_checksum) {
    report.corrupt.push_back({file.name,
                              "",
                              "",
                              file.path + " is corrupt: its bytes have CRC-32C " +
                                  checksum_text(actual) + " where " + kIndex + " records " +
                                  checksum_text(*file.root_checksum)});
  }
}

void check_shard_file(const FileToCheck& file, VerifyReport& report) {
  report.files += 1;
  Header header;
  try {
    header = read_header(file.path);
  } catch (const std::exception& e) {
    report.corrupt.push_back({file.name, "", "", text_of(e)});
    return;
  }
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
// among them goes to `report`.
std::vector<FileToCheck> files_of(const std::string& path, VerifyReport& report) {
  if (fs::is_regular_file(path)) {
    return {{path, path, std::nullopt}};
  }
  const auto directory = checkpoint_directory(path);
  Index index;
  try {
    index = read_index(directory);
  } catch (const std::exception& e) {
    report.corrupt.push_back({kIndex, "", "", text_of(e)});
    return {};
  }
  std::vector<FileToCheck> files;
  for (const auto& name : index.files) {
    files.push_back({(fs::path(directory) / name).string(), name, std::nullopt});
  }
  for (const auto& [name, crc] : index.checksums) {
    files.push_back({(fs::path(directory) / name).string(), name, crc});
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
  const auto files = files_of(path, report);
  std::vector<VerifyReport> found(files.size());
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t f = next++; f < files.size(); f = next++) {
      if (files[f].root_checksum) {
        check_root_file(files[f], found[f]);
      } else {
        check_shard_file(files[f], found[f]);
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
