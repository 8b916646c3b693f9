#pragma once
// JSON as checkpoint files hold it (safetensors headers, a checkpoint's index.json), read as
// untrusted input: nlohmann/json's parser (iterative, fuzzed upstream) drives a handler of ours
// that builds a JsonValue and bounds the nesting, so no file can exhaust the stack, make a
// number throw, or slip invalid UTF-8, control characters or trailing text through. What the
// values must be (which keys, which types, duplicates or not) is for the file's own rules
// (safetensors_header.h, index.h) to say.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torch_mp::checkpoint {

/// The deepest nesting of arrays and objects parse_json reads by default: serde_json's limit
/// (the safetensors package's parser), which refuses a header nested 128 levels deep.
inline constexpr int kMaxJsonDepth = 127;

/// The most values (numbers, strings, arrays, objects, ...) parse_json reads: a bound on the
/// memory one text can take (about 100 bytes a value), far above what a real header holds (a
/// tensor takes about 9: a million tensors fit).
inline constexpr int64_t kMaxJsonValues = int64_t{1} << 24;

struct JsonMember;

/// One JSON value.
struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  /// A number's value when it is an integer in [0, 2^64) written without a sign, fraction or
  /// exponent (what a size or an offset must be); nullopt for every other number.
  std::optional<uint64_t> count;
  /// A string's value (UTF-8; escapes resolved), or a number's text (an integer's value in
  /// decimal, a fraction or exponent as written).
  std::string text;
  std::vector<JsonValue> array;
  /// An object's members in the order written, a key written twice kept twice.
  std::vector<JsonMember> members;

  /// The last member named `key` of an object; null when it has none.
  const JsonValue* find(const std::string& key) const;
  /// The first key an object holds twice; nullopt when every key is written once.
  std::optional<std::string> repeated_key() const;
  /// "an object", "a string", ...: for error messages.
  const char* kind_name() const;
};

/// A member of a JSON object.
struct JsonMember {
  std::string key;
  JsonValue value;
};

/// Parses `text` as one JSON value (whitespace around it allowed, nothing else), nested at most
/// `max_depth` levels, of at most `max_values` values. Raises c10::Error "<context>: <what is
/// wrong> at byte <n>" for anything else: a syntax error, invalid UTF-8, a control character or
/// lone surrogate in a string, a number out of double's range, deeper nesting, more values.
JsonValue parse_json(std::string_view text,
                     const std::string& context,
                     int max_depth = kMaxJsonDepth,
                     int64_t max_values = kMaxJsonValues);

/// `value` as compact JSON text, members in their order, strings escaped as `quoted` does:
/// the same text for the same parsed content, however the file spaced it, and what Python's
/// json.dumps(value, ensure_ascii=False, separators=(",", ":")) writes of it (numbers aside:
/// an integer in decimal, a fraction as the file wrote it).
std::string json_text(const JsonValue& value);

/// `text` as a JSON string literal, quotes included: `"` and `\` escaped, \b \f \n \r \t as
/// such, other characters below 0x20 as \u00xx, everything else as it is.
std::string quoted(const std::string& text);

}  // namespace torch_mp::checkpoint
