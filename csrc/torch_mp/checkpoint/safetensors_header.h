#pragma once
// A safetensors file's header, read by the safetensors package's own rules, as untrusted input
// (c10 only, no ATen: what the fuzzer links).
//
//   8-byte little-endian length N | N bytes of JSON | the data region
//
// A file is accepted exactly when the `safetensors` package (0.8) accepts it
// (docs/checkpoint-format.md §9.2): N at most 100,000,000 and within the file; the JSON an object
// whose "__metadata__" (optional) maps strings to strings and whose every other member is a
// tensor {"dtype", "shape", "data_offsets": [begin, end]}, unknown fields ignored; the tensors,
// sorted by offsets, tile the data region from 0 to its end with no hole and no overlap, each
// exactly its shape's element count times its dtype's size (every product checked for
// overflow). A name written twice keeps its last entry, as the package's parser does (so an
// entry repeated identically is harmless, and any other repetition breaks the tiling or is the
// entry read). Everything else is refused with a c10::Error naming the file and what is wrong.

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace torch_mp::checkpoint {

/// The largest header the safetensors package reads (its MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

/// The metadata key under which torch_mp records a file's checksums.
inline constexpr const char* kChecksumKey = "torch_mp.crc32c";

/// Where one tensor lies in a safetensors file.
struct TensorEntry {
  at::ScalarType dtype;
  /// Its shape as torch holds it (file_shape gives the file's).
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data, which starts at Header::data_start
  uint64_t end = 0;
};

/// A safetensors file's header: its tensors by name, its metadata (without the checksums) and
/// the checksums it records.
struct Header {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
  /// Each tensor's CRC-32C by name; empty for a file written without them.
  std::map<std::string, uint32_t> checksums;
  uint64_t data_start = 0;

  /// Whether the file records checksums (one without tensors needs none).
  bool checksummed() const { return !checksums.empty() || tensors.empty(); }
};

/// The safetensors name of `dtype` ("F32"); raises, naming `tensor`, for a dtype the format
/// cannot hold.
const char* dtype_name(at::ScalarType dtype, const std::string& tensor);

/// The shape a file gives a tensor of `dtype` and torch shape `shape`: the same, but for F4
/// (torch's float4_e2m1fn_x2 holds two values an element: the file's last size is twice
/// torch's). Raises, naming `tensor`, for a 0-dim float4_e2m1fn_x2 tensor.
std::vector<int64_t> file_shape(at::ScalarType dtype,
                                c10::IntArrayRef shape,
                                const std::string& tensor);

/// The header length that the first 8 bytes `prefix` of the safetensors file `path`, of
/// `file_size` bytes, record. Raises unless it is at most kMaxHeaderBytes and the header fits
/// in the file.
uint64_t header_length(const unsigned char* prefix, uint64_t file_size, const std::string& path);

/// Reads `json`, the header of the safetensors file `path` of `file_size` bytes (after its
/// 8-byte length), by the rules above; the metadata entry kChecksumKey, if any, must be
/// torch_mp's checksums of the file's tensors.
Header parse_header(std::string_view json, uint64_t file_size, const std::string& path);

/// Reads only the header of the safetensors file `path` (header_length, then parse_header).
/// Raises, naming the file, if it cannot be read or is not a valid safetensors file.
Header read_header(const std::string& path);

/// The CRC-32C of the header of the safetensors file `path` (its 8-byte length and its JSON):
/// what a checkpoint's index records of each shard file, so that a damaged header (a dtype,
/// the checksums themselves) or a file from another save is caught.
uint32_t header_checksum(const std::string& path);

/// header_length, then parse_header, of `bytes`, a whole safetensors file (or its start,
/// through its header, with `file_size` its size): what the fuzzer runs.
Header parse_header_of(std::string_view bytes, uint64_t file_size, const std::string& path);

}  // namespace torch_mp::checkpoint
