// Crash-safe publication of a checkpoint directory (atomic_files.h): at every moment the
// checkpoint, or the earlier one set aside, is complete; what dead saves left is cleaned up.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tensor_checks.h"
#include "torch_mp/checkpoint/atomic_files.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

// A fresh, empty directory for one test.
fs::path fresh_directory(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("torch_mp_atomic_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void touch(const fs::path& file) { std::ofstream(file) << "x"; }

TEST(AtomicFiles, MoveIntoPlaceReplacesAnEarlierCheckpointAndRemovesIt) {
  const auto dir = fresh_directory("move");
  const auto path = (dir / "ckpt").string();
  fs::create_directories(path);
  touch(fs::path(path) / "old");
  const auto partial = partial_path(path, "00000000000000000007");
  fs::create_directories(partial);
  touch(fs::path(partial) / "new");
  move_into_place(partial, path, "00000000000000000007");
  EXPECT_TRUE(fs::exists(fs::path(path) / "new"));
  EXPECT_FALSE(fs::exists(fs::path(path) / "old"));
  EXPECT_FALSE(fs::exists(partial));
  EXPECT_FALSE(fs::exists(path + ".previous-00000000000000000007"));
}

TEST(AtomicFiles, LeftoversGoButACheckpointSetAsideStaysUntilANewOneIsComplete) {
  const auto dir = fresh_directory("leftovers");
  const auto path = (dir / "ckpt").string();
  fs::create_directories(path + ".partial-00000000000000000001");
  fs::create_directories(path + ".previous-00000000000000000002");
  remove_leftovers(path, "index.json");
  EXPECT_FALSE(fs::exists(path + ".partial-00000000000000000001"));
  EXPECT_TRUE(fs::exists(path + ".previous-00000000000000000002")) << "the only complete one";
  fs::create_directories(path);
  touch(fs::path(path) / "index.json");
  remove_leftovers(path, "index.json");
  EXPECT_FALSE(fs::exists(path + ".previous-00000000000000000002"));
}

TEST(AtomicFiles, AMissingCheckpointIsFoundInTheNewestOneSetAside) {
  const auto dir = fresh_directory("aside");
  const auto path = (dir / "ckpt").string();
  EXPECT_TRUE(testing::mentions(testing::error_of([&] { checkpoint_directory(path); }),
                                "no checkpoint at " + path));
  fs::create_directories(path + ".previous-00000000000000000002");
  fs::create_directories(path + ".previous-00000000000000000010");
  EXPECT_EQ(checkpoint_directory(path), path + ".previous-00000000000000000010");
  fs::create_directories(path);
  EXPECT_EQ(checkpoint_directory(path), path);
}

TEST(AtomicFiles, ASaveTagIsTwentyDigitsThatSortByTime) {
  const auto first = save_tag(nullptr);
  const auto second = save_tag(nullptr);
  EXPECT_EQ(first.size(), 20u);
  EXPECT_EQ(first.find_first_not_of("0123456789"), std::string::npos);
  EXPECT_LE(first, second);
}

TEST(AtomicFiles, WriteDurablyWritesTheWholeContents) {
  const auto file = (fresh_directory("write") / "root.json").string();
  write_durably(file, "{\"a\": 1}\n");
  std::ifstream in(file);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "{\"a\": 1}\n");
  EXPECT_TRUE(testing::mentions(
      testing::error_of([&] { write_durably((fs::path(file) / "no" / "such").string(), ""); }),
      "writing "));
}

}  // namespace
}  // namespace torch_mp::checkpoint
