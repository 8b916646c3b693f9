// CRC-32C (checksum.h): the reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF. The CPU's instruction where there is one (SSE4.2's crc32, three streams at once;
// ARMv8's crc32c*), otherwise a table, a byte at a time.

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
// The crc32 instruction takes 3 cycles and can start one a cycle: three streams, each over its
// third of a chunk, keep it busy, then are joined. Joining uses that the register after a
// stretch of zero bytes is a linear function of the register before it (a product by
// x^(8 * length) modulo the polynomial): shift_register applies it for one stream's length,
// from tables of its value on each byte of the register.
constexpr size_t kStreamBytes = 4096;

struct ShiftTables {
  std::array<std::array<uint32_t, 256>, 4> table{};

  ShiftTables() {
    static const std::array<unsigned char, kStreamBytes> zeros{};
    for (int k = 0; k < 4; ++k) {
      std::array<uint32_t, 8> of_bit{};
      for (int bit = 0; bit < 8; ++bit) {
        of_bit[bit] = crc32c_bytes(zeros.data(), zeros.size(), 1u << (8 * k + bit));
      }
      for (uint32_t value = 0; value < 256; ++value) {
        uint32_t shifted = 0;
        for (int bit = 0; bit < 8; ++bit) {
          shifted ^= (value >> bit) & 1u ? of_bit[bit] : 0u;
        }
        table[k][value] = shifted;
      }
    }
  }

  // The register after kStreamBytes zero bytes, from `crc`.
  uint32_t shift_register(uint32_t crc) const {
    return table[0][crc & 0xffu] ^ table[1][(crc >> 8) & 0xffu] ^ table[2][(crc >> 16) & 0xffu] ^
           table[3][crc >> 24];
  }
};

__attribute__((target("sse4.2"))) uint32_t crc32c_hardware(const unsigned char* bytes,
                                                           size_t size,
                                                           uint32_t crc) {
  static const ShiftTables shift;
  const auto word = [](const unsigned char* at) {
    uint64_t value;
    std::memcpy(&value, at, 8);
    return value;
  };
  for (; size >= 3 * kStreamBytes; bytes += 3 * kStreamBytes, size -= 3 * kStreamBytes) {
    uint64_t first = crc, second = 0, third = 0;
    for (size_t i = 0; i < kStreamBytes; i += 8) {
      first = _mm_crc32_u64(first, word(bytes + i));
      second = _mm_crc32_u64(second, word(bytes + kStreamBytes + i));
      third = _mm_crc32_u64(third, word(bytes + 2 * kStreamBytes + i));
    }
    crc = shift.shift_register(shift.shift_register(static_cast<uint32_t>(first)) ^
                               static_cast<uint32_t>(second)) ^
          static_cast<uint32_t>(third);
  }
  uint64_t wide = crc;
  for (; size >= 8; bytes += 8, size -= 8) {
    wide = _mm_crc32_u64(wide, word(bytes));
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
