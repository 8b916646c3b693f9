// The fuzz targets (targets.h).

#include "targets.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string_view>

#include "torch_mp/checkpoint/index.h"
#include "torch_mp/checkpoint/json.h"
#include "torch_mp/checkpoint/safetensors_header.h"

namespace torch_mp::fuzz {
namespace {

std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace

int json(const uint8_t* data, size_t size) {
  try {
    const auto text = checkpoint::json_text(checkpoint::parse_json(as_text(data, size), "input"));
    // What json_text writes must read back as itself (the index's checksum relies on it).
    if (checkpoint::json_text(checkpoint::parse_json(text, "json_text")) != text) {
      std::abort();
    }
  } catch (const c10::Error&) {
  }
  return 0;
}

int safetensors_header(const uint8_t* data, size_t size) {
  try {
    checkpoint::parse_header_of(as_text(data, size), size, "input");
  } catch (const c10::Error&) {
  }
  return 0;
}

int index(const uint8_t* data, size_t size) {
  try {
    checkpoint::parse_index(as_text(data, size), "index.json");
  } catch (const c10::Error&) {
  }
  return 0;
}

}  // namespace torch_mp::fuzz
