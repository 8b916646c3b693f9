// A safetensors file's header, read by the safetensors package's rules (safetensors_header.h).

#include "torch_mp/checkpoint/safetensors_header.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>

#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/json.h"

namespace torch_mp::checkpoint {
namespace {

// A dtype of the format: its name, its bits per element, and torch's type for it (Undefined
// for the two the safetensors package knows and torch has none for).
struct FileDtype {
  const char* name;
  uint64_t bits;
  at::ScalarType torch;
};

constexpr FileDtype kDtypes[] = {
    {"F64", 64, at::kDouble},
    {"F32", 32, at::kFloat},
    {"F16", 16, at::kHalf},
    {"BF16", 16, at::kBFloat16},
    {"I64", 64, at::kLong},
    {"I32", 32, at::kInt},
    {"I16", 16, at::kShort},
    {"I8", 8, at::kChar},
    {"U64", 64, at::kUInt64},
    {"U32", 32, at::kUInt32},
    {"U16", 16, at::kUInt16},
    {"U8", 8, at::kByte},
    {"BOOL", 8, at::kBool},
    {"F8_E4M3", 8, at::kFloat8_e4m3fn},
    {"F8_E4M3FNUZ", 8, at::kFloat8_e4m3fnuz},
    {"F8_E5M2", 8, at::kFloat8_e5m2},
    {"F8_E5M2FNUZ", 8, at::kFloat8_e5m2fnuz},
    {"F8_E8M0", 8, at::kFloat8_e8m0fnu},
    {"C64", 64, at::kComplexFloat},
    // Two 4-bit values a byte: torch's float4_e2m1fn_x2 holds a pair, so its last size is half
    // the file's.
    {"F4", 4, at::kFloat4_e2m1fn_x2},
    {"F6_E2M3", 6, at::ScalarType::Undefined},
    {"F6_E3M2", 6, at::ScalarType::Undefined},
};

// What `path`'s header says is wrong (the prefix of every refusal).
std::string not_valid(const std::string& path) { return path + ": not a valid safetensors file: "; }

// A tensor's entry as written, before the rules that involve the other tensors and torch.
struct WrittenEntry {
  const FileDtype* dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The reading of one header: every refusal names the file and the tensor.
class HeaderParser {
 public:
  explicit HeaderParser(const std::string& path) : path_(path) {}

  // A tensor's entry: {"dtype", "shape", "data_offsets"} with any other fields ignored, or
  // (as the safetensors package's parser also takes a struct) [dtype, shape, data_offsets].
  WrittenEntry entry(const JsonValue& value, const std::string& name) const {
    if (value.kind == JsonValue::Kind::kArray) {
      check(value.array.size() == 3,
            name,
            "is an array of " + std::to_string(value.array.size()) +
                " values, not [dtype, shape, data_offsets]");
      const auto [begin, end] = offsets(value.array[2], name);
      return {dtype(value.array[0], name), counts(value.array[1], name, "shape"), begin, end};
    }
    check(value.kind == JsonValue::Kind::kObject,
          name,
          "is " + std::string(value.kind_name()) +
              ", not an object {\"dtype\", \"shape\", \"data_offsets\"}");
    const auto field = [&](const char* key) {
      const auto times = std::count_if(value.members.begin(),
                                       value.members.end(),
                                       [&](const JsonMember& m) { return m.key == key; });
      check(times > 0, name, "has no " + quoted(key));
      check(times == 1, name, "gives " + quoted(key) + " twice");  // (unknown ones may repeat)
      return value.find(key);
    };
    const auto [begin, end] = offsets(*field("data_offsets"), name);
    return {dtype(*field("dtype"), name), counts(*field("shape"), name, "shape"), begin, end};
  }

  // The safetensors package's rule of the data region: sorted by their offsets, the tensors
  // tile it from 0 to its end, each exactly its size, every product checked for overflow as the
  // package checks it (elements, then bits, left to right).
  void check_tiling(const std::map<std::string, WrittenEntry>& entries,
                    uint64_t data_start,
                    uint64_t file_size) const {
    std::vector<std::pair<const std::string*, const WrittenEntry*>> order;
    for (const auto& [name, entry] : entries) {
      order.emplace_back(&name, &entry);
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
      return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
    });
    uint64_t covered = 0;
    for (const auto& [name, entry] : order) {
      check(entry->begin == covered && entry->end >= entry->begin,
            *name,
            "lies at bytes [" + std::to_string(entry->begin) + ", " + std::to_string(entry->end) +
                ") of the data, where the tensors before it end at " + std::to_string(covered) +
                " (tensors must follow one another with no hole or " + "overlap)");
      uint64_t bits = 1;
      for (const auto size : entry->shape) {
        check(!__builtin_mul_overflow(bits, size, &bits), *name, "has a size that overflows");
      }
      check(!__builtin_mul_overflow(bits, entry->dtype->bits, &bits),
            *name,
            "has a size that overflows");
      check(bits % 8 == 0, *name, "is not a whole number of bytes");
      check(bits / 8 == entry->end - entry->begin,
            *name,
            "takes " + std::to_string(entry->end - entry->begin) +
                " bytes where its dtype and shape need " + std::to_string(bits / 8));
      covered = entry->end;
    }
    TORCH_CHECK(data_start + covered == file_size,
                not_valid(path_),
                "its tensors end at byte ",
                data_start + covered,
                " of a file of ",
                file_size,
                " bytes (cut short, or bytes after the last tensor)");
  }

  // The tensor torch makes of `entry` (what the safetensors package's torch front end refuses:
  // a dtype torch lacks, a size beyond torch's, an F4 pair split).
  TensorEntry torch_entry(const WrittenEntry& entry, const std::string& name) const {
    check(entry.dtype->torch != at::ScalarType::Undefined,
          name,
          "has dtype " + std::string(entry.dtype->name) + ", which torch has no type for");
    TensorEntry out{entry.dtype->torch, {}, entry.begin, entry.end};
    for (const auto size : entry.shape) {
      check(size <= static_cast<uint64_t>(INT64_MAX), name, "has a size over 2^63 - 1");
      out.shape.push_back(static_cast<int64_t>(size));
    }
    if (out.dtype == at::kFloat4_e2m1fn_x2) {
      check(!out.shape.empty() && out.shape.back() % 2 == 0,
            name,
            "is F4 with an odd last size (torch holds F4 values in pairs)");
      out.shape.back() /= 2;
    }
    return out;
  }

  void check(bool ok, const std::string& name, const std::string& what) const {
    TORCH_CHECK(ok, not_valid(path_), "tensor ", quoted(name), " ", what);
  }

 private:
  const FileDtype* dtype(const JsonValue& value, const std::string& name) const {
    // A name, or (as the package's parser takes an enum) {"<name>": null}.
    const bool one_key = value.kind == JsonValue::Kind::kObject && value.members.size() == 1 &&
                         value.members[0].value.kind == JsonValue::Kind::kNull;
    check(value.kind == JsonValue::Kind::kString || one_key,
          name,
          "has a dtype that is " + std::string(value.kind_name()) + ", not a string");
    const auto& text = one_key ? value.members[0].key : value.text;
    for (const auto& d : kDtypes) {
      if (text == d.name) {
        return &d;
      }
    }
    check(false,
          name,
          "has dtype " + quoted(text) +
              ", which safetensors does not define (F64, F32, F16, BF16, I64, I32, I16, I8, "
              "U64, U32, U16, U8, BOOL, F8_E4M3, F8_E4M3FNUZ, F8_E5M2, F8_E5M2FNUZ, F8_E8M0, "
              "C64, F4; F6_E2M3 and F6_E3M2, which torch lacks)");
    return nullptr;
  }
  std::vector<uint64_t> counts(const JsonValue& value,
                               const std::string& name,
                               const char* field) const {
    check(value.kind == JsonValue::Kind::kArray,
          name,
          "has " + std::string(field) + " " + value.kind_name() + ", not an array");
    std::vector<uint64_t> out;
    for (const auto& count : value.array) {
      check(count.count.has_value(),
            name,
            "has " + std::string(field) + " holding " +
                (count.kind == JsonValue::Kind::kNumber ? count.text : count.kind_name()) +
                ", which is not an integer in [0, 2^64)");
      out.push_back(*count.count);
    }
    return out;
  }
  std::pair<uint64_t, uint64_t> offsets(const JsonValue& value, const std::string& name) const {
    const auto both = counts(value, name, "data_offsets");
    check(both.size() == 2, name, "has data_offsets that are not [begin, end]");
    return {both[0], both[1]};
  }

  const std::string& path_;
};

// The checksums that the metadata entry `text` of the file `path` records.
std::map<std::string, uint32_t> checksums_of(const std::string& text, const std::string& path) {
  const auto json = parse_json(text, path + ": malformed checksums in the header");
  TORCH_CHECK(json.kind == JsonValue::Kind::kObject && !json.repeated_key(),
              path,
              ": malformed checksums in the header");
  std::map<std::string, uint32_t> checksums;
  for (const auto& [name, value] : json.members) {
    const auto crc = parse_checksum(value.text);
    TORCH_CHECK(value.kind == JsonValue::Kind::kString && crc,
                path,
                ": malformed checksum of ",
                quoted(name),
                " in the header");
    checksums.emplace(name, *crc);
  }
  return checksums;
}

// The bytes a safetensors file's header occupies: its 8-byte length and its JSON.
struct HeaderBytes {
  unsigned char prefix[8] = {};
  std::string json;
  uint64_t file_size = 0;
};

HeaderBytes read_header_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors: cannot open ", path);
  in.seekg(0, std::ios::end);
  HeaderBytes bytes;
  bytes.file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  TORCH_CHECK(bytes.file_size >= 8, path, ": not a safetensors file (", bytes.file_size, " bytes)");
  in.read(reinterpret_cast<char*>(bytes.prefix), 8);
  bytes.json.resize(header_length(bytes.prefix, bytes.file_size, path));
  in.read(bytes.json.data(), static_cast<std::streamsize>(bytes.json.size()));
  TORCH_CHECK(in, path, ": reading the header failed");
  return bytes;
}

}  // namespace

Header read_header(const std::string& path) {
  const auto bytes = read_header_bytes(path);
  return parse_header(bytes.json, bytes.file_size, path);
}

uint32_t header_checksum(const std::string& path) {
  const auto bytes = read_header_bytes(path);
  return crc32c(bytes.json.data(), bytes.json.size(), crc32c(bytes.prefix, 8));
}

const char* dtype_name(at::ScalarType dtype, const std::string& tensor) {
  for (const auto& d : kDtypes) {
    if (d.torch == dtype && dtype != at::ScalarType::Undefined) {
      return d.name;
    }
  }
  TORCH_CHECK(false, "safetensors: ", tensor, " has dtype ", dtype, ", which it cannot hold");
}

std::vector<int64_t> file_shape(at::ScalarType dtype,
                                c10::IntArrayRef shape,
                                const std::string& tensor) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  if (dtype == at::kFloat4_e2m1fn_x2) {
    TORCH_CHECK(!out.empty(), "safetensors: ", tensor, " is a 0-dim float4_e2m1fn_x2 tensor");
    out.back() *= 2;  // (two F4 values each)
  }
  return out;
}

uint64_t header_length(const unsigned char* prefix, uint64_t file_size, const std::string& path) {
  TORCH_CHECK(file_size >= 8, path, ": not a safetensors file (", file_size, " bytes)");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | prefix[i];  // little-endian
  }
  TORCH_CHECK(length <= kMaxHeaderBytes,
              path,
              ": not a safetensors file: its header would be ",
              length,
              " bytes, over the format's limit of ",
              kMaxHeaderBytes);
  TORCH_CHECK(8 + length <= file_size,
              path,
              ": not a safetensors file, or cut short (a header of ",
              length,
              " bytes in a file of ",
              file_size,
              ")");
  return length;
}

Header parse_header(std::string_view json, uint64_t file_size, const std::string& path) {
  // (nlohmann/json skips a byte-order mark; the package's parser does not)
  TORCH_CHECK(json.substr(0, 3) != "\xef\xbb\xbf", not_valid(path), "the header starts with a BOM");
  const auto root = parse_json(json, not_valid(path) + "the header is not JSON");
  TORCH_CHECK(
      root.kind == JsonValue::Kind::kObject, not_valid(path), "the header is not an object");
  const HeaderParser parser(path);
  Header header;
  header.data_start = 8 + json.size();
  std::map<std::string, WrittenEntry> entries;
  bool metadata_seen = false;
  for (const auto& [name, value] : root.members) {
    if (name != "__metadata__") {
      // A name written twice: each must be well formed, the last is the tensor (the package's
      // parser fills a map).
      entries.insert_or_assign(name, parser.entry(value, name));
      continue;
    }
    TORCH_CHECK(!metadata_seen, not_valid(path), "the header gives \"__metadata__\" twice");
    metadata_seen = true;
    if (value.kind == JsonValue::Kind::kNull) {
      continue;
    }
    TORCH_CHECK(value.kind == JsonValue::Kind::kObject,
                not_valid(path),
                "\"__metadata__\" is ",
                value.kind_name(),
                ", not an object of strings");
    for (const auto& [key, text] : value.members) {
      TORCH_CHECK(text.kind == JsonValue::Kind::kString,
                  not_valid(path),
                  "the metadata value of ",
                  quoted(key),
                  " is ",
                  text.kind_name(),
                  ", not a string");
    }
    for (const auto& [key, text] : value.members) {
      if (key == kChecksumKey) {
        header.checksums = checksums_of(text.text, path);
      } else {
        header.metadata[key] = text.text;  // (a key written twice: the last wins)
      }
    }
  }
  parser.check_tiling(entries, header.data_start, file_size);
  for (const auto& [name, entry] : entries) {
    header.tensors.emplace(name, parser.torch_entry(entry, name));
  }
  return header;
}

Header parse_header_of(std::string_view bytes, uint64_t file_size, const std::string& path) {
  TORCH_CHECK(bytes.size() >= 8, path, ": not a safetensors file (", bytes.size(), " bytes)");
  const auto length =
      header_length(reinterpret_cast<const unsigned char*>(bytes.data()), file_size, path);
  TORCH_CHECK(8 + length <= bytes.size(), path, ": the header is cut short");
  return parse_header(bytes.substr(8, length), file_size, path);
}

}  // namespace torch_mp::checkpoint
