#pragma once
// The JSON that checkpoint files need: safetensors headers and a checkpoint's index.json.
// Objects, arrays, strings and integers are read as such; other literals (true, false, null,
// fractions) are kept as their text.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch_mp::checkpoint {

struct JsonValue {
  enum class Kind { kObject, kArray, kString, kNumber, kLiteral } kind = Kind::kNumber;
  std::map<std::string, JsonValue> object;
  std::vector<JsonValue> array;
  std::string string;  // a string's value, or a literal's text
  int64_t number = 0;
};

/// Parses `text`; raises "<context> (<what> at byte <n>)" on malformed input.
JsonValue parse_json(const std::string& text, const std::string& context);

/// `text` as a JSON string literal, quotes included.
std::string quoted(const std::string& text);

}  // namespace torch_mp::checkpoint
