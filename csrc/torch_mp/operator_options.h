#pragma once
// What a layer's declared options (options.h) derive: its operator's schema and the Options its
// kernel receives, the check that ranks agree on them, and the declaration Python reads.
//
//   TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
//     def_layer_operator<&parallel_mlp_op>(m, "parallel_mlp(Tensor x, Tensor fc1_weight, ...)");
//   }
//
// registers torch.ops.torch_mp.parallel_mlp with the schema's head as given and the options of
// ParallelMLPOptions appended as keyword-only arguments (`*, int hidden_size, ...,
// str activation="gelu", ...`), its kernel parallel_mlp_op(x, fc1_weight, ..., options): a
// composite (CompositeImplicitAutograd) of other operators, as the layers' forwards are.

#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/expanding_array.h>
#include <torch/library.h>

#include <charconv>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "torch_mp/agreement.h"
#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::options {

// ---- one option type: its schema type, its literal, and its IValue -----------------------------

/// How an option of C++ type T appears in a schema and crosses the dispatcher.
template <typename T>
struct OptionType;

template <>
struct OptionType<int64_t> {
  static constexpr const char* kSchema = "int";
  static std::string literal(int64_t v) { return std::to_string(v); }
  static int64_t from(const c10::IValue& v) { return v.toInt(); }
  static c10::IValue to(int64_t v) { return v; }
  static int64_t agreement(int64_t v) { return v; }
};

template <>
struct OptionType<double> {
  static constexpr const char* kSchema = "float";
  static std::string literal(double v) {
    char text[32];
    const auto end = std::to_chars(text, text + sizeof(text), v).ptr;
    std::string s(text, end);
    return s.find_first_of(".eEn") == std::string::npos ? s + ".0" : s;  // 2 -> 2.0
  }
  static double from(const c10::IValue& v) { return v.toDouble(); }
  static c10::IValue to(double v) { return v; }
  static int64_t agreement(double v) { return comm::bits(v); }
};

template <>
struct OptionType<bool> {
  static constexpr const char* kSchema = "bool";
  static std::string literal(bool v) { return v ? "True" : "False"; }
  static bool from(const c10::IValue& v) { return v.toBool(); }
  static c10::IValue to(bool v) { return v; }
  static int64_t agreement(bool v) { return v; }
};

template <>
struct OptionType<std::string> {
  static constexpr const char* kSchema = "str";
  static std::string literal(const std::string& v) { return "\"" + v + "\""; }
  static std::string from(const c10::IValue& v) { return v.toStringRef(); }
  static c10::IValue to(const std::string& v) { return v; }
  static int64_t agreement(const std::string& v) {
    return static_cast<int64_t>(std::hash<std::string>{}(v) >> 1);
  }
};

/// A process group, by its registered name ("" for none).
template <>
struct OptionType<GroupPtr> {
  static constexpr const char* kSchema = "str";
  static std::string literal(const GroupPtr& v) {
    TORCH_CHECK(!v, "torch_mp: a group option's default must be no group");
    return "\"\"";
  }
  static GroupPtr from(const c10::IValue& v) { return group_named_or_none(v.toStringRef()); }
  static c10::IValue to(const GroupPtr& v) { return v ? group_name(v) : std::string(); }
};

/// A list of sizes.
template <>
struct OptionType<std::vector<int64_t>> {
  static constexpr const char* kSchema = "int[]";
  static std::string literal(const std::vector<int64_t>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) {
      out += (i ? ", " : "") + std::to_string(v[i]);
    }
    return out + "]";
  }
  static std::vector<int64_t> from(const c10::IValue& v) { return v.toIntVector(); }
  static c10::IValue to(const std::vector<int64_t>& v) { return v; }
  static int64_t agreement(const std::vector<int64_t>& v) {
    return static_cast<int64_t>(std::hash<std::string>{}(literal(v)) >> 1);
  }
};

/// A pair of numbers, given as one number or two (torch::nn's ExpandingArray).
template <>
struct OptionType<torch::ExpandingArray<2>> {
  static constexpr const char* kSchema = "int[2]";
  static std::vector<int64_t> numbers(const torch::ExpandingArray<2>& v) {
    return {(*v)[0], (*v)[1]};
  }
  static std::string literal(const torch::ExpandingArray<2>& v) {
    return OptionType<std::vector<int64_t>>::literal(numbers(v));
  }
  static torch::ExpandingArray<2> from(const c10::IValue& v) {
    return v.isInt() ? torch::ExpandingArray<2>(v.toInt())
                     : torch::ExpandingArray<2>(v.toIntVector());
  }
  static c10::IValue to(const torch::ExpandingArray<2>& v) { return numbers(v); }
  static int64_t agreement(const torch::ExpandingArray<2>& v) {
    return OptionType<std::vector<int64_t>>::agreement(numbers(v));
  }
};

/// A pair of numbers or a name (a Conv2d's padding: numbers, "same" or "valid"). The schema's
/// "Any" takes no default: the operator's argument is required, the module's has the default.
template <>
struct OptionType<std::variant<torch::ExpandingArray<2>, std::string>> {
  using Value = std::variant<torch::ExpandingArray<2>, std::string>;
  static constexpr const char* kSchema = "Any";
  static constexpr bool kSchemaDefault = false;
  static std::string literal(const Value& v) {
    const auto* name = std::get_if<std::string>(&v);
    return name ? OptionType<std::string>::literal(*name)
                : OptionType<torch::ExpandingArray<2>>::literal(std::get<0>(v));
  }
  static Value from(const c10::IValue& v) {
    if (v.isString()) {
      return v.toStringRef();
    }
    if (v.isTuple()) {
      std::vector<int64_t> numbers;
      for (const auto& element : v.toTupleRef().elements()) {
        numbers.push_back(element.toInt());
      }
      return torch::ExpandingArray<2>(numbers);
    }
    return OptionType<torch::ExpandingArray<2>>::from(v);
  }
  static c10::IValue to(const Value& v) {
    const auto* name = std::get_if<std::string>(&v);
    return name ? c10::IValue(*name) : OptionType<torch::ExpandingArray<2>>::to(std::get<0>(v));
  }
  static int64_t agreement(const Value& v) {
    return OptionType<std::string>::agreement(literal(v));
  }
};

template <typename T>
struct OptionType<std::optional<T>> {
  static constexpr const char* kSchema = nullptr;  // T's, then "?" (schema_type)
  static std::string literal(const std::optional<T>& v) {
    return v ? OptionType<T>::literal(*v) : "None";
  }
  static std::optional<T> from(const c10::IValue& v) {
    return v.isNone() ? std::nullopt : std::optional<T>(OptionType<T>::from(v));
  }
  static c10::IValue to(const std::optional<T>& v) {
    return v ? OptionType<T>::to(*v) : c10::IValue();
  }
  static int64_t agreement(const std::optional<T>& v) {  // (a digest: None is a value too)
    return OptionType<std::string>::agreement(literal(v));
  }
};

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<std::optional<T>> : std::true_type {};

/// The schema type of an option of C++ type T ("int", "float?", ...).
template <typename T>
std::string schema_type() {
  if constexpr (IsOptional<T>::value) {
    return schema_type<typename T::value_type>() + "?";
  } else {
    return OptionType<T>::kSchema;
  }
}

template <typename T>
constexpr bool is_group = std::is_same_v<T, GroupPtr>;

/// Whether the schema can hold a default for an option of C++ type T.
template <typename T>
constexpr bool has_schema_default() {
  if constexpr (requires { OptionType<T>::kSchemaDefault; }) {
    return OptionType<T>::kSchemaDefault;
  } else {
    return true;
  }
}

// ---- a whole declaration -----------------------------------------------------------------------

/// One declared option as Python reads it (torch_mp._C.declared_options).
struct Declared {
  std::string name;
  /// "required", "option" or "keyword" (Kind).
  std::string kind;
  /// The schema type ("int", "float", "bool", "str", "int?", "float?", "int[]", "int[2]",
  /// "Any") or "group".
  std::string type;
  /// The default (None for a required option and for a group).
  c10::IValue default_value;
};

/// The declaration of `Options`' options, in order.
template <typename Options>
std::vector<Declared> declaration() {
  std::vector<Declared> out;
  const Options defaults = Options::declared_defaults();
  Options::for_each_option(defaults, [&](const char* name, const auto& value, Kind kind) {
    using T = std::decay_t<decltype(value)>;
    const char* kinds[] = {"required", "option", "keyword"};
    Declared d{name, kinds[static_cast<int>(kind)], is_group<T> ? "group" : schema_type<T>(), {}};
    if (kind != Kind::kRequired && !is_group<T>) {
      d.default_value = OptionType<T>::to(value);
    }
    out.push_back(std::move(d));
  });
  return out;
}

/// `Options`' options as schema arguments: "int hidden_size, bool bias=True, ...".
template <typename Options>
std::string schema_arguments() {
  std::string out;
  const Options defaults = Options::declared_defaults();
  Options::for_each_option(defaults, [&](const char* name, const auto& value, Kind kind) {
    using T = std::decay_t<decltype(value)>;
    out += (out.empty() ? "" : ", ") + schema_type<T>() + " " + name;
    if (kind != Kind::kRequired && has_schema_default<T>()) {
      out += "=" + OptionType<T>::literal(value);
    }
  });
  return out;
}

/// The number of options `Options` declares.
template <typename Options>
size_t count() {
  size_t n = 0;
  const Options defaults = Options::declared_defaults();
  Options::for_each_option(defaults, [&](const char*, const auto&, Kind) { ++n; });
  return n;
}

/// Options read from `values` (one per option, in order), as an operator receives them.
template <typename Options>
Options from_ivalues(const c10::IValue* values) {
  Options options = Options::declared_defaults();
  size_t i = 0;
  Options::for_each_option(options, [&](const char*, auto& value, Kind) {
    value = OptionType<std::decay_t<decltype(value)>>::from(values[i++]);
  });
  return options;
}

/// Raises on every rank, naming the options that differ, unless every rank of `group` holds
/// the same `options` (their groups aside): one small all-gather. `layer` names the layer in
/// the message ("<layer> configuration must be the same on every rank ...: dropout (here 0.1)").
template <typename Options>
void check_same_options(const Options& options, const GroupPtr& group, const std::string& layer) {
  std::vector<comm::NamedValue> values;
  Options::for_each_option(options, [&](const char* name, const auto& value, Kind) {
    using T = std::decay_t<decltype(value)>;
    if constexpr (!is_group<T>) {
      constexpr bool numeric = std::is_same_v<T, int64_t> || std::is_same_v<T, bool>;
      values.push_back(
          {name, OptionType<T>::agreement(value), OptionType<T>::literal(value), numeric});
    }
  });
  comm::check_same_values_across_ranks(values, group, layer + " configuration");
}

/// The options as text, "in_features=8, out_features=16, bias=True, ..." (groups left out), for
/// a module's pretty_print.
template <typename Options>
std::string describe(const Options& options) {
  std::string out;
  Options::for_each_option(options, [&](const char* name, const auto& value, Kind) {
    using T = std::decay_t<decltype(value)>;
    if constexpr (!is_group<T>) {
      out += (out.empty() ? "" : ", ") + std::string(name) + "=" + OptionType<T>::literal(value);
    }
  });
  return out;
}

/// Options of type `To` holding `from`'s options of the same names (the others at their
/// defaults; every required one of `To` must be among them): a layer's options handed to the
/// layer it is built on, say.
template <typename To, typename From>
To same_named(const From& from) {
  std::vector<std::pair<std::string, c10::IValue>> given;
  From::for_each_option(from, [&](const char* name, const auto& value, Kind) {
    given.emplace_back(name, OptionType<std::decay_t<decltype(value)>>::to(value));
  });
  To to = To::declared_defaults();
  To::for_each_option(to, [&](const char* name, auto& value, Kind kind) {
    for (const auto& [key, ivalue] : given) {
      if (key == name) {
        value = OptionType<std::decay_t<decltype(value)>>::from(ivalue);
        return;
      }
    }
    TORCH_CHECK(kind != Kind::kRequired, "same_named: no option '", name, "' to take");
  });
  return to;
}

// ---- the operator ------------------------------------------------------------------------------

namespace detail {

template <auto kernel>
struct BoxedLayerKernel;

// A kernel `Result kernel(Head..., const Options&)` as a boxed kernel: the head's arguments and
// then the options, from the stack.
template <typename Result, typename... Args, Result (*kernel)(Args...)>
struct BoxedLayerKernel<kernel> {
  static constexpr size_t kHead = sizeof...(Args) - 1;
  using Arguments = std::tuple<std::decay_t<Args>...>;
  using Options = std::tuple_element_t<kHead, Arguments>;

  static void call(const c10::OperatorHandle&, c10::Stack* stack) {
    const size_t n = kHead + count<Options>();
    const c10::IValue* first = stack->data() + (stack->size() - n);
    Result result = invoke(first, std::make_index_sequence<kHead>{});
    torch::jit::drop(*stack, n);
    if constexpr (std::is_same_v<Result, at::Tensor>) {
      torch::jit::push(*stack, std::move(result));
    } else {  // a tuple of tensors: one return each
      std::apply([&](auto&... r) { (torch::jit::push(*stack, std::move(r)), ...); }, result);
    }
  }

  template <size_t... I>
  static Result invoke(const c10::IValue* args, std::index_sequence<I...>) {
    return kernel(first_arguments<std::tuple_element_t<I, Arguments>>(args[I])...,
                  from_ivalues<Options>(args + kHead));
  }

  template <typename T>
  static T first_arguments(const c10::IValue& v) {
    if constexpr (std::is_same_v<T, std::string>) {
      return v.toStringRef();
    } else {
      return v.to<T>();
    }
  }
};

}  // namespace detail

/// Registers an operator whose schema is `head` (its name and leading arguments, without the
/// return: "parallel_mlp(Tensor x, Tensor fc1_weight, ...)") followed by the kernel's Options'
/// declared options as keyword-only arguments, returning `returns` (the kernel's result: a
/// Tensor or a tuple of them), and `kernel` (leading arguments, then the Options) as its
/// composite implementation.
template <auto kernel>
void def_layer_operator(torch::Library& m,
                        const std::string& head,
                        const std::string& returns = "Tensor") {
  using Kernel = detail::BoxedLayerKernel<kernel>;
  TORCH_CHECK(!head.empty() && head.back() == ')', "def_layer_operator: bad head ", head);
  const std::string schema = head.substr(0, head.size() - 1) + ", *, " +
                             schema_arguments<typename Kernel::Options>() + ") -> " + returns;
  // The head must name the kernel's leading arguments: the boxed kernel counts on it.
  TORCH_CHECK(torch::schema(schema.c_str()).arguments().size() ==
                  Kernel::kHead + count<typename Kernel::Options>(),
              "def_layer_operator: the head of ",
              schema,
              " does not hold the kernel's ",
              Kernel::kHead,
              " leading arguments");
  m.def(schema.c_str(), torch::CppFunction::makeFromBoxedFunction<&Kernel::call>());
}

}  // namespace torch_mp::options
