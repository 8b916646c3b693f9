#include "torch_mp/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/json.h"

namespace torch_mp::checkpoint {
namespace {

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};

constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"},
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
};

const char* name_of(at::ScalarType dtype, const std::string& tensor) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) {
      return d.name;
    }
  }
  TORCH_CHECK(false, "safetensors: ", tensor, " has dtype ", dtype, ", which it cannot hold");
}

at::ScalarType dtype_of(const std::string& name, const std::string& path) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      return d.dtype;
    }
  }
  TORCH_CHECK(false, path, ": unknown safetensors dtype '", name, "'");
}

// A tensor's checksum: the CRC-32C of its dtype and shape as the header gives them ("F32 2,3"),
// then of its bytes, so that a damaged header entry is caught as a damaged byte is.
uint32_t tensor_checksum(const char* dtype, c10::IntArrayRef shape, const at::Tensor& cpu) {
  std::string described = std::string(dtype) + " ";
  for (size_t d = 0; d < shape.size(); ++d) {
    described += (d ? "," : "") + std::to_string(shape[d]);
  }
  return crc32c(cpu.data_ptr(), cpu.nbytes(), crc32c(described.data(), described.size()));
}

// The metadata entry recording `checksums` (by tensor name).
std::string checksum_entry(const std::map<std::string, uint32_t>& checksums) {
  std::string text = "{";
  for (const auto& [name, crc] : checksums) {
    text += (text.size() > 1 ? "," : "") + quoted(name) + ":" + quoted(checksum_text(crc));
  }
  return text + "}";
}

// The checksums that the metadata entry `text` of the file `path` records.
std::map<std::string, uint32_t> parse_checksum_entry(const std::string& text,
                                                     const std::string& path) {
  const auto json = parse_json(text, path + ": malformed checksums in the header");
  TORCH_CHECK(json.kind == JsonValue::Kind::kObject, path, ": malformed checksums in the header");
  std::map<std::string, uint32_t> checksums;
  for (const auto& [name, value] : json.object) {
    const auto crc = parse_checksum(value.string);
    TORCH_CHECK(crc, path, ": malformed checksum '", value.string, "' of ", name);
    checksums.emplace(name, *crc);
  }
  return checksums;
}

// Raises checksum_problem's problem, if any.
void check_checksum(const std::string& path,
                    const Header& header,
                    const std::string& name,
                    const at::Tensor& data) {
  if (const auto problem = checksum_problem(path, header, name, data)) {
    TORCH_CHECK(false, *problem);
  }
}

}  // namespace

void save_file(const TensorMap& tensors,
               const std::string& path,
               const std::map<std::string, std::string>& metadata_in) {
  TORCH_CHECK(!metadata_in.count(kChecksumKey),
              "safetensors: the metadata key '",
              kChecksumKey,
              "' is reserved for the checksums (writing ",
              path,
              ")");
  std::vector<at::Tensor> data;
  std::map<std::string, uint32_t> checksums;
  for (const auto& [name, tensor] : tensors) {
    data.push_back(tensor.detach().to(at::kCPU).contiguous());
    checksums.emplace(
        name,
        tensor_checksum(
            name_of(data.back().scalar_type(), name), data.back().sizes(), data.back()));
  }
  auto metadata = metadata_in;
  metadata.emplace(kChecksumKey, checksum_entry(checksums));
  std::ostringstream header;
  header << "{\"__metadata__\":{";
  for (auto it = metadata.begin(); it != metadata.end(); ++it) {
    header << (it == metadata.begin() ? "" : ",") << quoted(it->first) << ":" << quoted(it->second);
  }
  header << "}";
  int64_t offset = 0;
  size_t index = 0;
  for (const auto& [name, tensor] : tensors) {
    const auto& cpu = data[index++];
    const auto bytes = static_cast<int64_t>(cpu.nbytes());
    header << "," << quoted(name) << ":{\"dtype\":\"" << name_of(cpu.scalar_type(), name)
           << "\",\"shape\":[";
    for (int64_t d = 0; d < cpu.dim(); ++d) {
      header << (d ? "," : "") << cpu.size(d);
    }
    header << "],\"data_offsets\":[" << offset << "," << offset + bytes << "]}";
    offset += bytes;
  }
  header << "}";
  std::string text = header.str();
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "safetensors: cannot write ", temporary);
    const uint64_t length = text.size();
    unsigned char prefix[8];
    for (int i = 0; i < 8; ++i) {
      prefix[i] = static_cast<unsigned char>((length >> (8 * i)) & 0xff);  // little-endian
    }
    out.write(reinterpret_cast<const char*>(prefix), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : data) {
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
    out.flush();
    TORCH_CHECK(out, "safetensors: writing ", temporary, " failed");
  }
  const int fd = ::open(temporary.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  TORCH_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0,
              "safetensors: cannot rename ",
              temporary,
              " to ",
              path);
}

Header read_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors: cannot open ", path);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  TORCH_CHECK(size >= 8, path, ": not a safetensors file (", size, " bytes)");
  unsigned char prefix[8];
  in.read(reinterpret_cast<char*>(prefix), 8);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | prefix[i];
  }
  TORCH_CHECK(8 + length <= size,
              path,
              ": not a safetensors file, or cut short (header of ",
              length,
              " bytes)");
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  TORCH_CHECK(in, path, ": reading the header failed");
  const auto json = parse_json(text, path + ": not a safetensors file");
  TORCH_CHECK(json.kind == JsonValue::Kind::kObject, path, ": the header is not an object");
  Header header;
  header.data_start = 8 + length;
  for (const auto& [name, entry] : json.object) {
    if (name == "__metadata__") {
      for (const auto& [key, value] : entry.object) {
        if (key == kChecksumKey) {
          header.checksums = parse_checksum_entry(value.string, path);
        } else {
          header.metadata[key] = value.string;
        }
      }
      continue;
    }
    const auto& fields = entry.object;
    TORCH_CHECK(fields.count("dtype") && fields.count("shape") && fields.count("data_offsets"),
                path,
                ": tensor ",
                name,
                " lacks dtype, shape or data_offsets");
    TensorEntry tensor{dtype_of(fields.at("dtype").string, path), {}, 0, 0};
    for (const auto& d : fields.at("shape").array) {
      tensor.shape.push_back(d.number);
    }
    const auto& offsets = fields.at("data_offsets").array;
    TORCH_CHECK(offsets.size() == 2, path, ": tensor ", name, " has malformed data_offsets");
    tensor.begin = static_cast<uint64_t>(offsets[0].number);
    tensor.end = static_cast<uint64_t>(offsets[1].number);
    int64_t numel = 1;
    for (const auto d : tensor.shape) {
      numel *= d;
    }
    TORCH_CHECK(tensor.end >= tensor.begin && header.data_start + tensor.end <= size &&
                    tensor.end - tensor.begin ==
                        static_cast<uint64_t>(numel * c10::elementSize(tensor.dtype)),
                path,
                ": tensor ",
                name,
                " is cut short or does not match its shape");
    header.tensors.emplace(name, std::move(tensor));
  }
  return header;
}

uint32_t header_checksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors: cannot open ", path);
  unsigned char prefix[8] = {};
  in.read(reinterpret_cast<char*>(prefix), 8);
  TORCH_CHECK(in, path, ": not a safetensors file");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | prefix[i];
  }
  in.seekg(0, std::ios::end);
  TORCH_CHECK(8 + length <= static_cast<uint64_t>(in.tellg()), path, ": the header is cut short");
  in.seekg(8);
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  TORCH_CHECK(in, path, ": reading the header failed");
  return crc32c(text.data(), text.size(), crc32c(prefix, 8));
}

std::optional<std::string> checksum_problem(const std::string& path,
                                            const Header& header,
                                            const std::string& name,
                                            const at::Tensor& data) {
  if (header.checksums.empty()) {
    return std::nullopt;
  }
  const auto recorded = header.checksums.find(name);
  if (recorded == header.checksums.end()) {
    return path + ": the header records no checksum for tensor " + name +
           " (the header is damaged)";
  }
  const auto& entry = header.tensors.at(name);
  const uint32_t actual = tensor_checksum(name_of(entry.dtype, name), entry.shape, data);
  if (actual == recorded->second) {
    return std::nullopt;
  }
  return path + ": tensor " + name + " is corrupt: its bytes have CRC-32C " +
         checksum_text(actual) + " where the file records " + checksum_text(recorded->second) +
         " (the file changed after it was written: a bad disk or a torn copy)";
}

TensorMap load_tensors(const std::string& path,
                       const Header& header,
                       const std::vector<std::string>& names) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors: cannot open ", path);
  TensorMap tensors;
  for (const auto& name : names) {
    const auto it = header.tensors.find(name);
    TORCH_CHECK(it != header.tensors.end(), path, " holds no tensor ", name);
    const auto& entry = it->second;
    auto tensor = at::empty(entry.shape, at::TensorOptions(entry.dtype));
    if (tensor.nbytes() > 0) {
      in.seekg(static_cast<std::streamoff>(header.data_start + entry.begin));
      in.read(static_cast<char*>(tensor.data_ptr()), static_cast<std::streamsize>(tensor.nbytes()));
      TORCH_CHECK(in, path, ": reading ", name, " failed");
    }
    check_checksum(path, header, name, tensor);
    tensors[name] = tensor;
  }
  return tensors;
}

void load_into(const std::string& path,
               const Header& header,
               const std::string& name,
               const at::Tensor& destination) {
  const auto it = header.tensors.find(name);
  TORCH_CHECK(it != header.tensors.end(), path, " holds no tensor ", name);
  const auto& entry = it->second;
  TORCH_CHECK(destination.is_cpu() && destination.is_contiguous() &&
                  destination.scalar_type() == entry.dtype &&
                  static_cast<uint64_t>(destination.nbytes()) == entry.end - entry.begin,
              "safetensors: cannot read ",
              name,
              " of ",
              path,
              " into a ",
              destination.scalar_type(),
              " tensor of shape ",
              destination.sizes());
  if (destination.nbytes() == 0) {
    return;
  }
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors: cannot open ", path);
  in.seekg(static_cast<std::streamoff>(header.data_start + entry.begin));
  in.read(static_cast<char*>(destination.data_ptr()),
          static_cast<std::streamsize>(destination.nbytes()));
  TORCH_CHECK(in, path, ": reading ", name, " failed");
  check_checksum(path, header, name, destination);
}

TensorMap load_file(const std::string& path, std::map<std::string, std::string>* metadata) {
  auto header = read_header(path);
  std::vector<std::string> names;
  for (const auto& item : header.tensors) {
    names.push_back(item.first);
  }
  if (metadata) {
    *metadata = header.metadata;
  }
  return load_tensors(path, header, names);
}

}  // namespace torch_mp::checkpoint
