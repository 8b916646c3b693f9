// A checkpoint's index.json, written and read (index.h).

#include "torch_mp/checkpoint/index.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/json.h"
#include "torch_mp/checkpoint/safetensors_header.h"

namespace torch_mp::checkpoint {
namespace {

constexpr const char* kIndexChecksum = "index_crc32c";
// Version 2 recorded its own checksum over the text before this field, as written.
constexpr const char* kVersion2ChecksumField = ",\n \"index_crc32c\": \"";

void write_checksums(std::ostringstream& out,
                     const char* field,
                     const std::map<std::string, uint32_t>& checksums) {
  out << ",\n " << quoted(field) << ": {";
  for (auto it = checksums.begin(); it != checksums.end(); ++it) {
    out << (it == checksums.begin() ? "\n  " : ",\n  ") << quoted(it->first) << ": "
        << quoted(checksum_text(it->second));
  }
  out << "\n }";
}

// The CRC-32C an index records of itself: of its parsed content without the field that
// records it, as json_text writes it.
uint32_t content_checksum(const JsonValue& root) {
  JsonValue content = root;
  std::erase_if(content.members, [](const auto& m) { return m.key == kIndexChecksum; });
  const auto text = json_text(content);
  return crc32c(text.data(), text.size());
}

// The reading of one index file: every refusal names it.
class IndexParser {
 public:
  explicit IndexParser(const std::string& path) : path_(path) {}

  Index parse(std::string_view text) {
    const auto root = parse_json(text, path_ + ": not a checkpoint index");
    check(root.kind == JsonValue::Kind::kObject, "it is not a JSON object");
    unique(root, "the index");
    const auto* format = root.find("format");
    check(format && format->kind == JsonValue::Kind::kString && format->text == kFormat,
          std::string("it is not a ") + kFormat + " index");
    Index index;
    index.version = version_of(root.find("version"));
    check_own_checksum(root, text, index.version);
    const auto* files = root.find("files");
    check(files && files->kind == JsonValue::Kind::kArray, "it lists no \"files\"");
    std::set<std::string> listed;
    for (const auto& file : files->array) {
      check(file.kind == JsonValue::Kind::kString,
            "\"files\" holds " + std::string(file.kind_name()));
      plain(file.text);
      check(listed.insert(file.text).second, "it lists " + quoted(file.text) + " twice");
      index.files.push_back(file.text);
    }
    if (const auto* metadata = root.find("metadata")) {
      index.metadata = strings_of(*metadata, "metadata");
    }
    const bool mandatory = index.version >= 3;
    index.checksums = checksums_of(root.find("checksums"), "checksums", mandatory);
    index.header_checksums =
        checksums_of(root.find("header_checksums"), "header_checksums", mandatory);
    for (const auto& file : index.files) {
      check(!mandatory || index.header_checksums.count(file),
            "it records no checksum of the header of " + quoted(file));
    }
    return index;
  }

 private:
  void check(bool ok, const std::string& what) const {
    TORCH_CHECK(ok, path_, " is not a valid checkpoint index: ", what);
  }
  void unique(const JsonValue& object, const std::string& what) const {
    if (const auto repeated = object.repeated_key()) {
      check(false, what + " gives " + quoted(*repeated) + " twice");
    }
  }
  void plain(const std::string& name) const {
    if (const auto problem = plain_name_problem(name)) {
      check(false, *problem);
    }
  }
  int64_t version_of(const JsonValue* version) const {
    const bool known = version && version->count && *version->count >= kOldestVersion &&
                       *version->count <= kVersion;
    TORCH_CHECK(known,
                path_,
                " is of version ",
                version ? json_text(*version) : "(none)",
                "; this torch_mp reads versions ",
                kOldestVersion,
                " to ",
                kVersion);
    return static_cast<int64_t>(*version->count);
  }
  void check_own_checksum(const JsonValue& root, std::string_view text, int64_t version) const {
    const auto* field = root.find(kIndexChecksum);
    if (version < 3) {  // (optional, over the text as written)
      const auto at = text.rfind(kVersion2ChecksumField);
      if (!field || at == std::string_view::npos) {
        return;
      }
      const auto recorded = parse_checksum(field->text);
      const uint32_t actual = crc32c(text.data(), at);
      corrupt_unless(recorded && *recorded == actual, actual, recorded);
      return;
    }
    check(field && field->kind == JsonValue::Kind::kString,
          std::string("it records no \"") + kIndexChecksum + "\" of itself");
    const auto recorded = parse_checksum(field->text);
    check(recorded.has_value(), "its " + std::string(kIndexChecksum) + " is malformed");
    const uint32_t actual = content_checksum(root);
    corrupt_unless(*recorded == actual, actual, recorded);
  }
  void corrupt_unless(bool ok, uint32_t actual, std::optional<uint32_t> recorded) const {
    TORCH_CHECK(ok,
                path_,
                " is corrupt: its content has CRC-32C ",
                checksum_text(actual),
                " where it records ",
                recorded ? checksum_text(*recorded) : std::string("a malformed one"));
  }
  std::map<std::string, std::string> strings_of(const JsonValue& object,
                                                const std::string& field) const {
    check(object.kind == JsonValue::Kind::kObject, quoted(field) + " is not an object");
    unique(object, quoted(field));
    std::map<std::string, std::string> out;
    for (const auto& [key, value] : object.members) {
      check(value.kind == JsonValue::Kind::kString,
            quoted(field) + " gives " + quoted(key) + " " + value.kind_name() + ", not a string");
      out.emplace(key, value.text);
    }
    return out;
  }
  std::map<std::string, uint32_t> checksums_of(const JsonValue* object,
                                               const std::string& field,
                                               bool mandatory) const {
    std::map<std::string, uint32_t> checksums;
    check(object || !mandatory, "it records no " + quoted(field));
    if (!object) {
      return checksums;
    }
    for (const auto& [name, text] : strings_of(*object, field)) {
      plain(name);
      const auto crc = parse_checksum(text);
      check(crc.has_value(), "malformed checksum " + quoted(text) + " of " + quoted(name));
      checksums.emplace(name, *crc);
    }
    return checksums;
  }

  const std::string& path_;
};

}  // namespace

std::optional<std::string> plain_name_problem(const std::string& name) {
  if (name.empty() || name == "." || name == ".." ||
      name.find_first_of(std::string("/\\\0", 3)) != std::string::npos) {
    return "it names " + quoted(name) +
           ", which is not a plain file name inside the checkpoint directory";
  }
  return std::nullopt;
}

std::string index_text(const Index& index) {
  std::ostringstream out;
  out << "{\n \"format\": " << quoted(kFormat) << ",\n \"version\": " << kVersion
      << ",\n \"files\": [";
  for (size_t i = 0; i < index.files.size(); ++i) {
    out << (i ? ", " : "") << quoted(index.files[i]);
  }
  out << "],\n \"metadata\": {";
  for (auto it = index.metadata.begin(); it != index.metadata.end(); ++it) {
    out << (it == index.metadata.begin() ? "\n  " : ",\n  ") << quoted(it->first) << ": "
        << quoted(it->second);
  }
  out << "\n }";
  write_checksums(out, "checksums", index.checksums);
  write_checksums(out, "header_checksums", index.header_checksums);
  const std::string text = out.str();
  const uint32_t crc = content_checksum(parse_json(text + "}", "index_text"));
  return text + ",\n " + quoted(kIndexChecksum) + ": " + quoted(checksum_text(crc)) + "\n}\n";
}

Index parse_index(std::string_view text, const std::string& index_path) {
  return IndexParser(index_path).parse(text);
}

Index read_index(const std::string& directory) {
  namespace fs = std::filesystem;
  const auto index_path = (fs::path(directory) / kIndex).string();
  TORCH_CHECK(fs::exists(index_path),
              directory,
              " has no ",
              kIndex,
              ": the save that wrote it did not finish");
  TORCH_CHECK(fs::is_regular_file(fs::symlink_status(index_path)),
              index_path,
              " is not read: it is not a regular file (a link, a device or a directory)");
  std::string text;
  {
    std::ifstream in(index_path, std::ios::binary);
    in.seekg(0, std::ios::end);
    const auto size = static_cast<uint64_t>(in.tellg());
    TORCH_CHECK(in && size <= kMaxHeaderBytes,
                index_path,
                " cannot be read, or is larger than an index can be (",
                kMaxHeaderBytes,
                " bytes)");
    text.resize(size);
    in.seekg(0);
    in.read(text.data(), static_cast<std::streamsize>(size));
    TORCH_CHECK(in, "reading ", index_path, " failed");
  }
  auto index = parse_index(text, index_path);
  std::vector<std::string> named = index.files;
  for (const auto& [name, crc] : index.checksums) {
    named.push_back(name);
  }
  for (const auto& name : named) {
    const auto status = fs::symlink_status(fs::path(directory) / name);
    TORCH_CHECK(!fs::exists(status) || fs::is_regular_file(status),
                index_path,
                " names ",
                quoted(name),
                ", which is ",
                fs::is_symlink(status) ? "a link" : "not a regular file",
                " (a checkpoint's files are regular files inside its directory)");
  }
  return index;
}

std::optional<std::string> header_problem(const Index& index,
                                          const std::string& directory,
                                          const std::string& name) {
  const auto recorded = index.header_checksums.find(name);
  if (recorded == index.header_checksums.end()) {
    return std::nullopt;  // (version 2; version 3 records every file's)
  }
  const auto path = (std::filesystem::path(directory) / name).string();
  const uint32_t actual = header_checksum(path);
  if (actual == recorded->second) {
    return std::nullopt;
  }
  return path + ": the header is corrupt, or the file is not the one this checkpoint saved: its " +
         "CRC-32C is " + checksum_text(actual) + " where " + kIndex + " records " +
         checksum_text(recorded->second);
}

std::optional<std::string> root_file_problem(const Index& index,
                                             const std::string& directory,
                                             const std::string& name,
                                             const std::string& contents) {
  const auto file = (std::filesystem::path(directory) / name).string();
  const auto recorded = index.checksums.find(name);
  if (recorded == index.checksums.end()) {
    if (index.version < 3) {
      return std::nullopt;
    }
    return file + " is not read: " + kIndex + " records no checksum of it (a file that was not " +
           "saved with the checkpoint)";
  }
  const uint32_t actual = crc32c(contents.data(), contents.size());
  if (actual == recorded->second) {
    return std::nullopt;
  }
  return file + " is corrupt: its bytes have CRC-32C " + checksum_text(actual) + " where " +
         kIndex + " records " + checksum_text(recorded->second);
}

}  // namespace torch_mp::checkpoint
