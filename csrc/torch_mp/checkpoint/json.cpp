#include "torch_mp/checkpoint/json.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdio>
#include <cstring>

namespace torch_mp::checkpoint {

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

namespace {

class Parser {
 public:
  using Value = JsonValue;
  Parser(const std::string& text, const std::string& context) : text_(text), context_(context) {}

  Value parse() {
    Value value = next();
    skip();
    check(at_ == text_.size(), "text after the value");
    return value;
  }

 private:
  void check(bool ok, const char* what) const {
    TORCH_CHECK(ok, context_, " (", what, " at byte ", at_, ")");
  }
  void skip() {
    while (at_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[at_]))) {
      ++at_;
    }
  }
  char peek() {
    skip();
    check(at_ < text_.size(), "the header ends early");
    return text_[at_];
  }
  void expect(char c) {
    check(peek() == c, "unexpected character");
    ++at_;
  }
  Value next() {
    Value value;
    const char c = peek();
    if (c == '{') {
      value.kind = Value::Kind::kObject;
      ++at_;
      if (peek() == '}') {
        ++at_;
        return value;
      }
      while (true) {
        std::string key = string();
        expect(':');
        value.object[key] = next();
        if (peek() == ',') {
          ++at_;
          continue;
        }
        expect('}');
        return value;
      }
    }
    if (c == '[') {
      value.kind = Value::Kind::kArray;
      ++at_;
      if (peek() == ']') {
        ++at_;
        return value;
      }
      while (true) {
        value.array.push_back(next());
        if (peek() == ',') {
          ++at_;
          continue;
        }
        expect(']');
        return value;
      }
    }
    if (c == '"') {
      value.kind = Value::Kind::kString;
      value.string = string();
      return value;
    }
    size_t end = at_;
    while (end < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[end])) ||
                                  std::strchr("+-.", text_[end]) != nullptr)) {
      ++end;
    }
    check(end > at_, "not a value");
    const std::string token = text_.substr(at_, end - at_);
    const bool integer =
        token.find_first_not_of("0123456789", token[0] == '-' ? 1 : 0) == std::string::npos &&
        token != "-";
    if (integer) {
      value.number = std::stoll(token);
    } else {
      value.kind = Value::Kind::kLiteral;
      value.string = token;
    }
    at_ = end;
    return value;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      check(at_ < text_.size(), "an unterminated string");
      const char c = text_[at_++];
      if (c == '"') {
        return out;
      }
      if (c != '\\') {
        out += c;
        continue;
      }
      check(at_ < text_.size(), "an unterminated escape");
      const char e = text_[at_++];
      if (e == 'u') {
        check(at_ + 4 <= text_.size(), "a short \\u escape");
        const auto code = std::stoi(text_.substr(at_, 4), nullptr, 16);
        at_ += 4;
        check(code < 0x80, "a non-ASCII \\u escape");
        out += static_cast<char>(code);
      } else {
        const std::string plain = "\"\\/";
        const std::string from = "bfnrt";
        const std::string to = "\b\f\n\r\t";
        if (plain.find(e) != std::string::npos) {
          out += e;
        } else {
          const auto i = from.find(e);
          check(i != std::string::npos, "an unknown escape");
          out += to[i];
        }
      }
    }
  }

  const std::string& text_;
  const std::string& context_;
  size_t at_ = 0;
};

}  // namespace

JsonValue parse_json(const std::string& text, const std::string& context) {
  return Parser(text, context).parse();
}

}  // namespace torch_mp::checkpoint
