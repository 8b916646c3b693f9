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

#include <map>
#include <string>

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

/// Reads a safetensors file: its tensors (on CPU) and, if `metadata` is given, its metadata.
/// Raises, naming the file, if it is not safetensors or is cut short.
TensorMap load_file(const std::string& path,
                    std::map<std::string, std::string>* metadata = nullptr);

}  // namespace torch_mp::checkpoint
