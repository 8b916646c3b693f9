#pragma once
// The checksum of every block a checkpoint writes: CRC-32C (Castagnoli), as iSCSI, ext4, Btrfs
// and most object stores use. It detects every error burst of up to 32 bits (four flipped bytes
// in a row among them), x86-64 (SSE4.2) and ARMv8 compute it in hardware at several GB/s, far
// faster than a disk takes the bytes, and it needs no library.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace torch_mp::checkpoint {

/// The CRC-32C of the `size` bytes at `data`, continuing the CRC `crc` of the bytes before
/// them (0 to start): crc32c(b, n, crc32c(a, m)) is the CRC of a followed by b.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

/// `crc` as it is recorded in files: eight lowercase hex digits.
std::string checksum_text(uint32_t crc);

/// The CRC that `text` records (checksum_text's form); nullopt if it is not that form.
std::optional<uint32_t> parse_checksum(const std::string& text);

}  // namespace torch_mp::checkpoint
