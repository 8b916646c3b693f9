#include "torch_mp/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace torch_mp::checkpoint {
namespace {

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};

constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"},
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
};

const char* name_of(at::ScalarType dtype, const std::string& tensor) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) {
      return d.name;
    }
  }
  TORCH_CHECK(false, "safetensors: ", tensor, " has dtype ", dtype, ", which it cannot hold");
}

at::ScalarType dtype_of(const std::string& name, const std::string& path) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      return d.dtype;
    }
  }
  TORCH_CHECK(false, path, ": unknown safetensors dtype '", name, "'");
}

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

// The subset of JSON a safetensors header uses: objects, arrays, strings, integers.
class Json {
 public:
  Json(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  struct Value {
    enum class Kind { kObject, kArray, kString, kNumber } kind = Kind::kNumber;
    std::map<std::string, Value> object;
    std::vector<Value> array;
    std::string string;
    int64_t number = 0;
  };

  Value parse() {
    Value value = next();
    skip();
    check(at_ == text_.size(), "text after the header's object");
    return value;
  }

 private:
  void check(bool ok, const char* what) const {
    TORCH_CHECK(ok, path_, ": not a safetensors file (", what, " at byte ", at_, " of the header)");
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
    check(c == '-' || std::isdigit(static_cast<unsigned char>(c)), "not a value");
    size_t end = at_ + 1;
    while (end < text_.size() && std::isdigit(static_cast<unsigned char>(text_[end]))) {
      ++end;
    }
    value.number = std::stoll(text_.substr(at_, end - at_));
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
  const std::string& path_;
  size_t at_ = 0;
};

}  // namespace

void save_file(const TensorMap& tensors,
               const std::string& path,
               const std::map<std::string, std::string>& metadata) {
  std::ostringstream header;
  header << "{";
  bool first = true;
  if (!metadata.empty()) {
    header << "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      header << (it == metadata.begin() ? "" : ",") << quoted(it->first) << ":"
             << quoted(it->second);
    }
    header << "}";
    first = false;
  }
  std::vector<at::Tensor> data;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const auto cpu = tensor.detach().to(at::kCPU).contiguous();
    const auto bytes = static_cast<int64_t>(cpu.nbytes());
    header << (first ? "" : ",") << quoted(name) << ":{\"dtype\":\""
           << name_of(cpu.scalar_type(), name) << "\",\"shape\":[";
    for (int64_t d = 0; d < cpu.dim(); ++d) {
      header << (d ? "," : "") << cpu.size(d);
    }
    header << "],\"data_offsets\":[" << offset << "," << offset + bytes << "]}";
    first = false;
    offset += bytes;
    data.push_back(cpu);
  }
  header << "}";
  std::string text = header.str();
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "safetensors: cannot write ", temporary);
    const uint64_t length = text.size();
    unsigned char prefix[8];
    for (int i = 0; i < 8; ++i) {
      prefix[i] = static_cast<unsigned char>((length >> (8 * i)) & 0xff);  // little-endian
    }
    out.write(reinterpret_cast<const char*>(prefix), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : data) {
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
    out.flush();
    TORCH_CHECK(out, "safetensors: writing ", temporary, " failed");
  }
  const int fd = ::open(temporary.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  TORCH_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0,
              "safetensors: cannot rename ",
              temporary,
              " to ",
              path);
}

TensorMap load_file(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors: cannot open ", path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(bytes.size() >= 8, path, ": not a safetensors file (", bytes.size(), " bytes)");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | static_cast<unsigned char>(bytes[i]);
  }
  TORCH_CHECK(8 + length <= bytes.size(),
              path,
              ": not a safetensors file, or cut short (header of ",
              length,
              " bytes)");
  const std::string text = bytes.substr(8, length);
  const auto header = Json(text, path).parse();
  TORCH_CHECK(header.kind == Json::Value::Kind::kObject, path, ": the header is not an object");
  const size_t body = 8 + length;
  TensorMap tensors;
  for (const auto& [name, entry] : header.object) {
    if (name == "__metadata__") {
      if (metadata) {
        for (const auto& [key, value] : entry.object) {
          (*metadata)[key] = value.string;
        }
      }
      continue;
    }
    const auto& fields = entry.object;
    TORCH_CHECK(fields.count("dtype") && fields.count("shape") && fields.count("data_offsets"),
                path,
                ": tensor ",
                name,
                " lacks dtype, shape or data_offsets");
    std::vector<int64_t> shape;
    for (const auto& d : fields.at("shape").array) {
      shape.push_back(d.number);
    }
    const auto& offsets = fields.at("data_offsets").array;
    TORCH_CHECK(offsets.size() == 2, path, ": tensor ", name, " has malformed data_offsets");
    const auto begin = static_cast<size_t>(offsets[0].number);
    const auto end = static_cast<size_t>(offsets[1].number);
    auto tensor = at::empty(shape, at::TensorOptions(dtype_of(fields.at("dtype").string, path)));
    TORCH_CHECK(end >= begin && body + end <= bytes.size() &&
                    end - begin == static_cast<size_t>(tensor.nbytes()),
                path,
                ": tensor ",
                name,
                " is cut short or does not match its shape");
    if (tensor.nbytes() > 0) {
      std::memcpy(tensor.data_ptr(), bytes.data() + body + begin, tensor.nbytes());
    }
    tensors[name] = tensor;
  }
  return tensors;
}

}  // namespace torch_mp::checkpoint
