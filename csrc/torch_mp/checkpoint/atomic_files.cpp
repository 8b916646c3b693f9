// A checkpoint directory written beside its path and renamed into place (atomic_files.h).

#include "torch_mp/checkpoint/atomic_files.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <vector>

#include "torch_mp/comm.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.rfind(prefix, 0) == 0;
}

}  // namespace

std::string save_tag(const GroupPtr& group) {
  const bool root = !group || group->getRank() == 0;
  auto token = at::zeros({1}, at::kLong);
  if (root) {
    token[0] = static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
  }
  if (group && group->getSize() > 1) {
    token = comm::all_reduce(token, group, c10d::ReduceOp::SUM);
  }
  std::string tag = std::to_string(token.item<int64_t>());
  tag.insert(0, 20 - std::min<size_t>(20, tag.size()), '0');
  return tag;
}

std::string partial_path(const std::string& path, const std::string& tag) {
  return path + ".partial-" + tag;
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_durably(const std::string& file, const std::string& contents) {
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    TORCH_CHECK(out, "writing ", file, " failed");
  }
  fsync_path(file);
}

void move_into_place(const std::string& partial, const std::string& path, const std::string& tag) {
  std::string previous;
  if (fs::exists(path)) {
    previous = path + ".previous-" + tag;
    fs::rename(path, previous);
  }
  fs::rename(partial, path);
  fsync_path(fs::path(path).parent_path().string());
  if (!previous.empty()) {
    std::error_code ignored;
    fs::remove_all(previous, ignored);
  }
}

void remove_leftovers(const std::string& path, const std::string& last_written) {
  const fs::path p(path);
  const auto parent = p.parent_path();
  if (!fs::is_directory(parent)) {
    return;
  }
  const bool complete = fs::exists(p / last_written);
  const auto base = p.filename().string();
  for (const auto& entry : fs::directory_iterator(parent)) {
    const auto name = entry.path().filename().string();
    if (starts_with(name, base + ".partial-") ||
        (complete && starts_with(name, base + ".previous-"))) {
      std::error_code ignored;
      fs::remove_all(entry.path(), ignored);
    }
  }
}

std::string checkpoint_directory(const std::string& path) {
  if (fs::is_directory(path)) {
    return path;
  }
  const fs::path p(path);
  const auto parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  std::vector<std::string> aside;
  if (fs::is_directory(parent)) {
    for (const auto& entry : fs::directory_iterator(parent)) {
      if (starts_with(entry.path().filename().string(), p.filename().string() + ".previous-")) {
        aside.push_back(entry.path().string());
      }
    }
  }
  TORCH_CHECK(!aside.empty(), "no checkpoint at ", path);
  std::sort(aside.begin(), aside.end());
  return aside.back();
}

}  // namespace torch_mp::checkpoint
