// A checkpoint's index.json, written and read (index.h).

#include "torch_mp/checkpoint/index.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/json.h"
#include "torch_mp/checkpoint/safetensors.h"

namespace torch_mp::checkpoint {
namespace {

constexpr const char* kIndexChecksumField = ",\n \"index_crc32c\": \"";

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

std::map<std::string, uint32_t> read_checksums(const std::map<std::string, JsonValue>& fields,
                                               const char* field,
                                               const std::string& index_path) {
  std::map<std::string, uint32_t> checksums;
  if (!fields.count(field)) {
    return checksums;
  }
  for (const auto& [name, value] : fields.at(field).object) {
    const auto crc = parse_checksum(value.string);
    TORCH_CHECK(crc, index_path, ": malformed checksum '", value.string, "' of ", name);
    checksums.emplace(name, *crc);
  }
  return checksums;
}

}  // namespace

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
  return text + kIndexChecksumField + checksum_text(crc32c(text.data(), text.size())) + "\"\n}\n";
}

Index read_index(const std::string& directory) {
  const auto index_path = (std::filesystem::path(directory) / kIndex).string();
  TORCH_CHECK(std::filesystem::exists(index_path),
              directory,
              " has no ",
              kIndex,
              ": the save that wrote it did not finish");
  std::ifstream in(index_path);
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  // Its own checksum: of the text before the field that records it.
  const auto field = text.rfind(kIndexChecksumField);
  if (field != std::string::npos) {
    const auto recorded =
        parse_checksum(text.substr(field + std::string(kIndexChecksumField).size(), 8));
    const uint32_t actual = crc32c(text.data(), field);
    TORCH_CHECK(recorded && *recorded == actual,
                index_path,
                " is corrupt: its text has CRC-32C ",
                checksum_text(actual),
                " where it records ",
                recorded ? checksum_text(*recorded) : std::string("a malformed one"));
  }
  const auto json = parse_json(text, index_path + ": not a checkpoint index");
  const auto& fields = json.object;
  TORCH_CHECK(fields.count("format") && fields.at("format").string == kFormat,
              index_path,
              " is not a ",
              kFormat,
              " index");
  TORCH_CHECK(fields.count("version") && fields.at("version").number == kVersion,
              index_path,
              " is of version ",
              fields.count("version") ? fields.at("version").number : 0,
              "; this torch_mp reads version ",
              kVersion);
  Index index;
  if (fields.count("metadata")) {
    for (const auto& [key, value] : fields.at("metadata").object) {
      index.metadata[key] = value.string;
    }
  }
  index.checksums = read_checksums(fields, "checksums", index_path);
  index.header_checksums = read_checksums(fields, "header_checksums", index_path);
  TORCH_CHECK(fields.count("files"), index_path, " lists no files");
  for (const auto& name : fields.at("files").array) {
    index.files.push_back(name.string);
  }
  return index;
}

std::optional<std::string> header_problem(const Index& index,
                                          const std::string& directory,
                                          const std::string& name) {
  const auto recorded = index.header_checksums.find(name);
  if (recorded == index.header_checksums.end()) {
    return std::nullopt;
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
  const auto recorded = index.checksums.find(name);
  if (recorded == index.checksums.end()) {
    return std::nullopt;
  }
  const uint32_t actual = crc32c(contents.data(), contents.size());
  if (actual == recorded->second) {
    return std::nullopt;
  }
  return (std::filesystem::path(directory) / name).string() +
         " is corrupt: its bytes have CRC-32C " + checksum_text(actual) + " where " + kIndex +
         " records " + checksum_text(recorded->second);
}

}  // namespace torch_mp::checkpoint
