#include "torch_mp/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/json.h"
#include "torch_mp/checkpoint/safetensors_header.h"

namespace torch_mp::checkpoint {
namespace {

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

// An empty tensor of `entry`'s dtype and shape. (One without elements is a view of none, as
// reshape makes it: its contiguous strides may overflow, [0, 2^62, 4], where a view's need not.)
at::Tensor empty_like_entry(const TensorEntry& entry) {
  const auto options = at::TensorOptions(entry.dtype);
  if (std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end()) {
    return at::empty({0}, options).reshape(entry.shape);
  }
  return at::empty(entry.shape, options);
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
            dtype_name(data.back().scalar_type(), name), data.back().sizes(), data.back()));
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
    header << "," << quoted(name) << ":{\"dtype\":\"" << dtype_name(cpu.scalar_type(), name)
           << "\",\"shape\":[";
    const auto shape = file_shape(cpu.scalar_type(), cpu.sizes(), name);
    for (size_t d = 0; d < shape.size(); ++d) {
      header << (d ? "," : "") << shape[d];
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
  const uint32_t actual = tensor_checksum(dtype_name(entry.dtype, name), entry.shape, data);
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
    auto tensor = empty_like_entry(entry);
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
