#pragma once
// A layer's options, declared once.
//
// Each layer lists its options in one X-macro of three kinds of entries:
//
//   #define TORCH_MP_PARALLEL_MLP_OPTIONS(REQUIRED, OPTION, KEYWORD)
//     REQUIRED(int64_t, hidden_size)
//     REQUIRED(int64_t, ffn_hidden_size)
//     OPTION(bool, bias, true)
//     OPTION(std::string, activation, "gelu")
//     OPTION(double, dropout, 0.0)
//     OPTION(bool, sequence_parallel, false)
//     OPTION(GroupPtr, group, {})
//
// (mlp.h; ParallelSelfAttention's list ends in KEYWORD entries such as
// KEYWORD(bool, recompute_core, false))
//
// with each line ending in a backslash, and its Options struct's body is
// TORCH_MP_OPTIONS(ParallelMLPOptions, TORCH_MP_PARALLEL_MLP_OPTIONS): a constructor taking the
// REQUIRED options in order, a TORCH_ARG (setter and getter, as LibTorch's options have) for
// every option with its default, and for_each_option, which visits them by name. Everything
// else is derived from that one list:
//   - the operator's schema: its options are keyword-only arguments with the same names, types
//     and defaults (operator_options.h: def_layer_operator);
//   - the Options the operator's kernel receives, read back from the operator's arguments;
//   - the check that every rank of a group holds the same options (check_same_options);
//   - the Python module's constructor, forward call and from_dense (torch_mp/_options.py reads
//     the declaration through torch_mp._C.declared_options): REQUIRED options come first,
//     OPTION ones may be passed by position after them, KEYWORD ones by keyword only.
//
// Option types: int64_t, double, bool, std::string, GroupPtr (a process group; by name in the
// operator and Python, "" or None for none), std::optional<int64_t>, std::optional<double>,
// std::vector<int64_t>, torch::ExpandingArray<2> ("int[2]": a number or a pair) and a number
// pair or a name (std::variant<torch::ExpandingArray<2>, std::string>: the schema's "Any",
// which takes no default there).
// Entries cannot hold `//` comments (the line continuation would end inside them): document the
// options above the list.

#include <torch/arg.h>

#include <type_traits>
#include <utility>

namespace torch_mp::options {

/// How an option is passed (see the top of this file).
enum class Kind {
  kRequired,  ///< the Options constructor's, and positional in Python
  kOption,    ///< has a default; positional or keyword in Python
  kKeyword,   ///< has a default; keyword only in Python
};

/// A required option's value in Options::declared_defaults(): zero.
template <typename T>
T blank() {
  if constexpr (std::is_default_constructible_v<T>) {
    return T{};
  } else {
    return T(0);  // torch::ExpandingArray
  }
}

/// The last parameter of a generated Options constructor (it lets the list of REQUIRED
/// parameters end in a comma).
struct EndOfRequired {};

}  // namespace torch_mp::options

// ---- the generator (one expansion of the list per derived part) -------------------------------
// clang-format off

#define TORCH_MP_OPTIONS_IGNORE(...)
#define TORCH_MP_OPTIONS_PARAMETER(T, name) T name,
#define TORCH_MP_OPTIONS_BLANK_ARGUMENT(T, name) ::torch_mp::options::blank<T>(),
#define TORCH_MP_OPTIONS_ASSIGN(T, name) this->name##_ = std::move(name);
#define TORCH_MP_OPTIONS_REQUIRED_MEMBER(T, name) \
  TORCH_ARG(T, name) = ::torch_mp::options::blank<T>();
#define TORCH_MP_OPTIONS_MEMBER(T, name, ...) TORCH_ARG(T, name) = __VA_ARGS__;
#define TORCH_MP_OPTIONS_VISIT_REQUIRED(T, name) \
  visit(#name, self.name##_, ::torch_mp::options::Kind::kRequired);
#define TORCH_MP_OPTIONS_VISIT_OPTION(T, name, ...) \
  visit(#name, self.name##_, ::torch_mp::options::Kind::kOption);
#define TORCH_MP_OPTIONS_VISIT_KEYWORD(T, name, ...) \
  visit(#name, self.name##_, ::torch_mp::options::Kind::kKeyword);

/// The body of an Options struct whose options `LIST` declares (see the top of this file).
#define TORCH_MP_OPTIONS(Name, LIST)                                                     \
 public:                                                                                 \
  /* The REQUIRED options, in the list's order. */                                      \
  Name(LIST(TORCH_MP_OPTIONS_PARAMETER, TORCH_MP_OPTIONS_IGNORE, TORCH_MP_OPTIONS_IGNORE) \
           ::torch_mp::options::EndOfRequired = {}) {                                    \
    LIST(TORCH_MP_OPTIONS_ASSIGN, TORCH_MP_OPTIONS_IGNORE, TORCH_MP_OPTIONS_IGNORE)      \
  }                                                                                      \
  /* Every option at its default, the required ones zero: the declaration's defaults. */ \
  static Name declared_defaults() {                                                      \
    return Name(LIST(TORCH_MP_OPTIONS_BLANK_ARGUMENT,                                    \
                     TORCH_MP_OPTIONS_IGNORE,                                            \
                     TORCH_MP_OPTIONS_IGNORE)::torch_mp::options::EndOfRequired{});      \
  }                                                                                      \
  /* Calls visit(name, value, kind) for every option, in the list's order. */            \
  template <typename Self, typename Visit>                                               \
  static void for_each_option(Self& self, Visit&& visit) {                               \
    LIST(TORCH_MP_OPTIONS_VISIT_REQUIRED,                                                \
         TORCH_MP_OPTIONS_VISIT_OPTION,                                                  \
         TORCH_MP_OPTIONS_VISIT_KEYWORD)                                                 \
  }                                                                                      \
  LIST(TORCH_MP_OPTIONS_REQUIRED_MEMBER, TORCH_MP_OPTIONS_MEMBER, TORCH_MP_OPTIONS_MEMBER) \
 public:
// clang-format on
