// A checkpoint's index.json, written and read (index.h).

#include "torch_mp/checkpoint/index.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/json.h"

namespace torch_mp::checkpoint {

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
  out << "\n },\n \"checksums\": {";
  for (auto it = index.checksums.begin(); it != index.checksums.end(); ++it) {
    out << (it == index.checksums.begin() ? "\n  " : ",\n  ") << quoted(it->first) << ": "
        << quoted(checksum_text(it->second));
  }
  out << "\n }\n}\n";
  return out.str();
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
  if (fields.count("checksums")) {
    for (const auto& [name, value] : fields.at("checksums").object) {
      const auto crc = parse_checksum(value.string);
      TORCH_CHECK(crc, index_path, ": malformed checksum '", value.string, "' of ", name);
      index.checksums.emplace(name, *crc);
    }
  }
  TORCH_CHECK(fields.count("files"), index_path, " lists no files");
  for (const auto& name : fields.at("files").array) {
    index.files.push_back(name.string);
  }
  return index;
}

}  // namespace torch_mp::checkpoint
