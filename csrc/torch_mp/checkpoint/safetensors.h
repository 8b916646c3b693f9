#pragma once
// The safetensors file format, for LibTorch applications: the same bytes the Python front end
// (torch_mp.checkpoint.save_file / load_file) and the `safetensors` package read and write.
//
//   8-byte little-endian header length | JSON header, space-padded to a multiple of 8 |
//   tensor bytes (little-endian, C order), at the offsets the header gives
//
//   header: {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...,
//            "__metadata__": {"<key>": "<value>"}}

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch_mp::checkpoint {

/// Tensors by name, in name order.
using TensorMap = std::map<std::string, at::Tensor>;

/// Writes `tensors` (copied to CPU) and `metadata` to `path`, atomically: into a temporary file
/// beside it, flushed to disk, then renamed over `path`, so that a process killed mid-write
/// leaves the previous file whole. Raises on a dtype safetensors cannot hold (F64, F32, F16,
/// BF16, I64, I32, I16, I8, U8 and BOOL can) or an I/O error, naming the file.
void save_file(const TensorMap& tensors,
               const std::string& path,
               const std::map<std::string, std::string>& metadata = {});

/// Where one tensor lies in a safetensors file.
struct TensorEntry {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data, which starts at Header::data_start
  uint64_t end = 0;
};

/// A safetensors file's header: its tensors by name and its metadata.
struct Header {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;
};

/// Reads only the header of the safetensors file `path` (checked against the file's size).
Header read_header(const std::string& path);

/// Reads the tensors `names` (on CPU) of the file `path`, whose header is `header`.
TensorMap load_tensors(const std::string& path,
                       const Header& header,
                       const std::vector<std::string>& names);

/// Reads the tensor `name` of the file `path` straight into `destination`, a contiguous CPU
/// tensor of its dtype and number of elements.
void load_into(const std::string& path,
               const Header& header,
               const std::string& name,
               const at::Tensor& destination);

/// Reads a safetensors file: its tensors (on CPU) and, if `metadata` is given, its metadata.
/// Raises, naming the file, if it is not safetensors or is cut short.
TensorMap load_file(const std::string& path,
                    std::map<std::string, std::string>* metadata = nullptr);

}  // namespace torch_mp::checkpoint
