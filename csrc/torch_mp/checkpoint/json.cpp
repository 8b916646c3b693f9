// JSON read from untrusted files (json.h).

#include "torch_mp/checkpoint/json.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

namespace torch_mp::checkpoint {

const JsonValue* JsonValue::find(const std::string& key) const {
  for (auto it = members.rbegin(); it != members.rend(); ++it) {
    if (it->key == key) {
      return &it->value;
    }
  }
  return nullptr;
}

std::optional<std::string> JsonValue::repeated_key() const {
  std::set<std::string_view> seen;
  for (const auto& member : members) {
    if (!seen.insert(member.key).second) {
      return member.key;
    }
  }
  return std::nullopt;
}

const char* JsonValue::kind_name() const {
  switch (kind) {
    case Kind::kNull:
      return "null";
    case Kind::kBool:
      return "a boolean";
    case Kind::kNumber:
      return "a number";
    case Kind::kString:
      return "a string";
    case Kind::kArray:
      return "an array";
    case Kind::kObject:
      return "an object";
  }
  return "a value";
}

std::string quoted(const std::string& text) {
  // Python's json.dumps(..., ensure_ascii=False) escapes the same characters the same way.
  std::string out = "\"";
  for (char c : text) {
    const char* shortcut = nullptr;
    switch (c) {
      case '"':
        shortcut = "\\\"";
        break;
      case '\\':
        shortcut = "\\\\";
        break;
      case '\b':
        shortcut = "\\b";
        break;
      case '\f':
        shortcut = "\\f";
        break;
      case '\n':
        shortcut = "\\n";
        break;
      case '\r':
        shortcut = "\\r";
        break;
      case '\t':
        shortcut = "\\t";
        break;
    }
    if (shortcut) {
      out += shortcut;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

namespace {

using Json = nlohmann::json;

// nlohmann/json's parser calls these as it reads; they build the JsonValue on a stack of the
// values still open. Returning false stops the parse (too deep).
class Builder : public nlohmann::json_sax<Json> {
 public:
  Builder(int max_depth, int64_t max_values) : max_depth_(max_depth), max_values_(max_values) {}

  bool null() override { return add(JsonValue{}); }
  bool boolean(bool value) override {
    JsonValue v;
    v.kind = JsonValue::Kind::kBool;
    v.boolean = value;
    return add(std::move(v));
  }
  // (nlohmann/json reads a number with a minus sign as number_integer, one without as
  // number_unsigned, and one with a fraction, an exponent or beyond 64 bits as number_float.)
  bool number_integer(number_integer_t value) override {
    return add(number(value == 0 ? "-0" : std::to_string(value), std::nullopt));
  }
  bool number_unsigned(number_unsigned_t value) override {
    return add(number(std::to_string(value), value));
  }
  bool number_float(number_float_t, const string_t& text) override {
    return add(number(text, std::nullopt));
  }
  bool string(string_t& value) override {
    JsonValue v;
    v.kind = JsonValue::Kind::kString;
    v.text = std::move(value);
    return add(std::move(v));
  }
  bool binary(binary_t&) override { return false; }  // (not in JSON text)
  bool start_object(std::size_t) override { return open(JsonValue::Kind::kObject); }
  bool key(string_t& value) override {
    key_ = std::move(value);
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(JsonValue::Kind::kArray); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t position,
                   const std::string&,
                   const nlohmann::detail::exception& error) override {
    error_ = error.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 2: syntax error ..."
    const auto colon = error_.find(": ");
    if (colon != std::string::npos) {
      error_ = error_.substr(colon + 2);
    }
    position_ = position;
    return false;
  }

  std::string error_;
  std::size_t position_ = 0;
  JsonValue result_;
  bool too_deep_ = false;
  bool too_many_ = false;

 private:
  static JsonValue number(std::string text, std::optional<uint64_t> count) {
    JsonValue v;
    v.kind = JsonValue::Kind::kNumber;
    v.text = std::move(text);
    v.count = count;
    return v;
  }
  // Places a complete value into the array or object open around it (or as the result).
  bool add(JsonValue value) {
    if (++values_ > max_values_) {
      too_many_ = true;
      return false;
    }
    if (open_.empty()) {
      result_ = std::move(value);
    } else if (open_.back().kind == JsonValue::Kind::kArray) {
      open_.back().array.push_back(std::move(value));
    } else {
      open_.back().members.push_back({std::move(key_), std::move(value)});
    }
    return true;
  }
  bool open(JsonValue::Kind kind) {
    if (static_cast<int>(open_.size()) >= max_depth_) {
      too_deep_ = true;
      return false;
    }
    // (an object's key is kept with it until the object closes)
    keys_.push_back(std::move(key_));
    open_.emplace_back();
    open_.back().kind = kind;
    return true;
  }
  bool close() {
    JsonValue value = std::move(open_.back());
    open_.pop_back();
    key_ = std::move(keys_.back());
    keys_.pop_back();
    return add(std::move(value));
  }

  int max_depth_;
  int64_t max_values_;
  int64_t values_ = 0;
  std::vector<JsonValue> open_;
  std::vector<std::string> keys_;
  std::string key_;
};

// `text` with every byte that is not printable ASCII written as \xNN: an error message quotes
// what it read, which may be any bytes, and must stay valid UTF-8 (Python decodes it).
std::string printable(const std::string& text) {
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out += c;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", static_cast<unsigned>(byte));
      out += escaped;
    }
  }
  return out;
}

void write_json(const JsonValue& value, std::string& out) {
  switch (value.kind) {
    case JsonValue::Kind::kNull:
      out += "null";
      return;
    case JsonValue::Kind::kBool:
      out += value.boolean ? "true" : "false";
      return;
    case JsonValue::Kind::kNumber:
      out += value.text;
      return;
    case JsonValue::Kind::kString:
      out += quoted(value.text);
      return;
    case JsonValue::Kind::kArray:
      out += '[';
      for (size_t i = 0; i < value.array.size(); ++i) {
        out += i ? "," : "";
        write_json(value.array[i], out);
      }
      out += ']';
      return;
    case JsonValue::Kind::kObject:
      out += '{';
      for (size_t i = 0; i < value.members.size(); ++i) {
        out += (i ? "," : "") + quoted(value.members[i].key) + ":";
        write_json(value.members[i].value, out);
      }
      out += '}';
      return;
  }
}

}  // namespace

JsonValue parse_json(std::string_view text,
                     const std::string& context,
                     int max_depth,
                     int64_t max_values) {
  // (nlohmann/json takes a NUL for the end of its input, and would ignore what follows one; a
  // NUL is never valid JSON, raw in a string or between values)
  const auto nul = text.find('\0');
  TORCH_CHECK(nul == std::string_view::npos, context, ": a NUL byte (at byte ", nul, ")");
  Builder builder(max_depth, max_values);
  const bool parsed = Json::sax_parse(text.begin(), text.end(), &builder);
  TORCH_CHECK(!builder.too_deep_, context, ": nested deeper than ", max_depth, " levels");
  TORCH_CHECK(!builder.too_many_, context, ": more than ", max_values, " values");
  TORCH_CHECK(
      parsed, context, ": ", printable(builder.error_), " (at byte ", builder.position_, ")");
  return std::move(builder.result_);
}

std::string json_text(const JsonValue& value) {
  std::string out;
  write_json(value, out);
  return out;
}

}  // namespace torch_mp::checkpoint
