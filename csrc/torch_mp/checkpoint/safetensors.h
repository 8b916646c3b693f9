#pragma once
// The safetensors file format, for LibTorch applications: the same bytes the Python front end
// (torch_mp.checkpoint.save_file / load_file) and the `safetensors` package read and write.
//
//   8-byte little-endian header length | JSON header, space-padded to a multiple of 8 |
//   tensor bytes (little-endian, C order), at the offsets the header gives
//
//   header: {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...,
//            "__metadata__": {"<key>": "<value>",
//                             "torch_mp.crc32c": "{\"<name>\": \"1a2b3c4d\", ...}"}}
//
// torch_mp records every tensor's CRC-32C (checksum.h) of its dtype, shape and bytes in the
// metadata entry "torch_mp.crc32c" (a JSON object, as a string, since safetensors metadata
// values are strings) and checks it whenever it reads the tensor, so a damaged file is
// refused, naming it and the tensor, instead of loaded. Files without the entry (other
// writers', torch_mp's before it) are read unchecked. Headers are read as untrusted input, by
// the safetensors package's own rules (safetensors_header.h).

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/checkpoint/safetensors_header.h"

namespace torch_mp::checkpoint {

/// Tensors by name, in name order.
using TensorMap = std::map<std::string, at::Tensor>;

/// Writes `tensors` (copied to CPU), their checksums and `metadata` to `path`, atomically: into
/// a temporary file beside it, flushed to disk, then renamed over `path`, so that a process
/// killed mid-write leaves the previous file whole. Raises on a dtype safetensors cannot hold
/// (every dtype torch has a safetensors name for can: safetensors_header.h), on metadata under
/// the reserved key "torch_mp.crc32c", or on an I/O error, naming the file.
void save_file(const TensorMap& tensors,
               const std::string& path,
               const std::map<std::string, std::string>& metadata = {});

/// What is wrong with `data`, read as the tensor `name` of the file `path`: its CRC-32C is not
/// the one `header` records, or the file records checksums but none for it. nullopt when it
/// is intact, or the file records no checksums.
std::optional<std::string> checksum_problem(const std::string& path,
                                            const Header& header,
                                            const std::string& name,
                                            const at::Tensor& data);

/// Reads the tensors `names` (on CPU) of the file `path`, whose header is `header`, each
/// checked against its checksum. Raises, naming the file and the tensor, on a mismatch.
TensorMap load_tensors(const std::string& path,
                       const Header& header,
                       const std::vector<std::string>& names);

/// Reads the tensor `name` of the file `path` straight into `destination`, a contiguous CPU
/// tensor of its dtype and number of elements, checked against its checksum (raises as
/// load_tensors).
void load_into(const std::string& path,
               const Header& header,
               const std::string& name,
               const at::Tensor& destination);

/// Reads a safetensors file: its tensors (on CPU) and, if `metadata` is given, its metadata.
/// Raises, naming the file, if it is not a valid safetensors file (whatever the safetensors
/// package refuses: safetensors_header.h) or a tensor fails its checksum.
TensorMap load_file(const std::string& path,
                    std::map<std::string, std::string>* metadata = nullptr);

}  // namespace torch_mp::checkpoint
