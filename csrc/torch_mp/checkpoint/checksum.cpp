// CRC-32C (checksum.h): the reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF. The CPU's instruction where there is one (SSE4.2's crc32, ARMv8's crc32c*),
// otherwise a table, a byte at a time.

#include "torch_mp/checkpoint/checksum.h"

#include <array>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

namespace torch_mp::checkpoint {
namespace {

constexpr uint32_t kCastagnoli = 0x82F63B78u;

constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc >> 1) ^ ((crc & 1u) ? kCastagnoli : 0u);
    }
    table[byte] = crc;
  }
  return table;
}

constexpr auto kCrc32cTable = crc32c_table();

// `crc` is the running (pre-inverted) value in all three.
uint32_t crc32c_bytes(const unsigned char* bytes, size_t size, uint32_t crc) {
  for (size_t i = 0; i < size; ++i) {
    crc = (crc >> 8) ^ kCrc32cTable[(crc ^ bytes[i]) & 0xffu];
  }
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hardware(const unsigned char* bytes,
                                                           size_t size,
                                                           uint32_t crc) {
  uint64_t wide = crc;
  for (; size >= 8; bytes += 8, size -= 8) {
    uint64_t word;
    std::memcpy(&word, bytes, 8);
    wide = _mm_crc32_u64(wide, word);
  }
  crc = static_cast<uint32_t>(wide);
  for (; size > 0; ++bytes, --size) {
    crc = _mm_crc32_u8(crc, *bytes);
  }
  return crc;
}

bool has_crc32c_instruction() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
uint32_t crc32c_hardware(const unsigned char* bytes, size_t size, uint32_t crc) {
  for (; size >= 8; bytes += 8, size -= 8) {
    uint64_t word;
    std::memcpy(&word, bytes, 8);
    crc = __crc32cd(crc, word);
  }
  for (; size > 0; ++bytes, --size) {
    crc = __crc32cb(crc, *bytes);
  }
  return crc;
}

bool has_crc32c_instruction() { return true; }
#else
uint32_t crc32c_hardware(const unsigned char* bytes, size_t size, uint32_t crc) {
  return crc32c_bytes(bytes, size, crc);
}

bool has_crc32c_instruction() { return false; }
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const uint32_t running = ~crc;
  return ~(has_crc32c_instruction() ? crc32c_hardware(bytes, size, running)
                                    : crc32c_bytes(bytes, size, running));
}

std::string checksum_text(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08x", crc);
  return text;
}

std::optional<uint32_t> parse_checksum(const std::string& text) {
  if (text.size() != 8 || text.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return std::nullopt;
  }
  return static_cast<uint32_t>(std::stoul(text, nullptr, 16));
}

}  // namespace torch_mp::checkpoint
