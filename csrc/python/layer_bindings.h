#pragma once
// The layers' declared options (torch_mp/options.h) as Python reads them:
//
//   torch_mp._C.declared_options("ParallelMLP")
//       -> [(name, kind, type, default), ...] in declaration order
//   torch_mp._C.check_options("ParallelMLP", {"hidden_size": 8, ..., "group": "<name>"})
//       the layer's construction-time check (sizes, agreement across ranks)
//   torch_mp._C.child_options("ParallelMLP", {...})
//       {"fc1": {...}, "fc2": {...}}: the options of the layers it is made of, as the C++
//       module builds them (mlp.h: fc1_options, fc2_options)
//
// Each bindings file registers its layers with bind_layer<Options>(name, check, children);
// torch_mp's Python modules derive their constructor, forward call, from_dense and children
// from the declaration.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "torch_mp/operator_options.h"

namespace torch_mp::python {

/// What Python needs of one layer's declaration (hidden, as pybind11's own types are).
struct __attribute__((visibility("hidden"))) LayerBinding {
  std::vector<options::Declared> declared;
  /// Runs the layer's check on options given by name (groups by name).
  std::function<void(const pybind11::dict&)> check;
  /// The options of each layer it is made of, by attribute, from its own options.
  std::function<pybind11::dict(const pybind11::dict&)> children;
};

/// The registered layers, by the name of their module.
std::map<std::string, LayerBinding>& layer_bindings();

namespace detail {

template <typename T>
T option_from_python(const pybind11::handle& value) {
  if constexpr (std::is_same_v<T, GroupPtr>) {
    return group_named_or_none(value.cast<std::string>());
  } else if constexpr (std::is_same_v<T, torch::ExpandingArray<2>>) {
    return pybind11::isinstance<pybind11::int_>(value) ? T(value.cast<int64_t>())
                                                       : T(value.cast<std::vector<int64_t>>());
  } else if constexpr (std::is_same_v<T, std::variant<torch::ExpandingArray<2>, std::string>>) {
    if (pybind11::isinstance<pybind11::str>(value)) {
      return value.cast<std::string>();
    }
    return option_from_python<torch::ExpandingArray<2>>(value);
  } else {
    return value.cast<T>();
  }
}

template <typename T>
pybind11::object option_to_python(const T& value) {
  if constexpr (std::is_same_v<T, GroupPtr>) {
    return pybind11::str(value ? group_name(value) : std::string());
  } else if constexpr (std::is_same_v<T, torch::ExpandingArray<2>>) {
    return pybind11::make_tuple((*value)[0], (*value)[1]);
  } else if constexpr (std::is_same_v<T, std::variant<torch::ExpandingArray<2>, std::string>>) {
    const auto* name = std::get_if<std::string>(&value);
    return name ? pybind11::str(*name) : option_to_python(std::get<0>(value));
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return pybind11::tuple(pybind11::cast(value));
  } else {
    return pybind11::cast(value);
  }
}

}  // namespace detail

/// Options of type `Options` from a Python dict of them by name: every required option must be
/// given, the others default; raises TypeError naming an option the layer does not declare.
template <typename Options>
Options options_from_python(const pybind11::dict& given, const std::string& layer) {
  Options result = Options::declared_defaults();
  size_t used = 0;
  Options::for_each_option(result, [&](const char* name, auto& value, options::Kind kind) {
    if (given.contains(name)) {
      value = detail::option_from_python<std::decay_t<decltype(value)>>(given[name]);
      ++used;
    } else if (kind == options::Kind::kRequired) {
      throw pybind11::type_error(layer + ": missing the required option '" + name + "'");
    }
  });
  if (used != given.size()) {
    const auto declared = options::declaration<Options>();
    for (const auto& item : given) {
      const auto name = std::string(pybind11::str(item.first));
      bool known = false;
      for (const auto& d : declared) {
        known = known || d.name == name;
      }
      if (!known) {
        throw pybind11::type_error(layer + " has no option '" + name + "'");
      }
    }
  }
  return result;
}

/// `options` as a Python dict by name (groups by name, "" for none; pairs as tuples).
template <typename Options>
pybind11::dict options_to_python(const Options& options) {
  pybind11::dict out;
  Options::for_each_option(options, [&](const char* name, const auto& value, options::Kind) {
    using T = std::decay_t<decltype(value)>;
    out[name] = detail::option_to_python<T>(value);
  });
  return out;
}

/// One layer a layer is made of: the attribute that holds it and its options.
template <typename Options>
struct __attribute__((visibility("hidden"))) ChildBinding {
  std::string attribute;
  std::function<pybind11::dict(const Options&)> options;
};

/// The child at `attribute`, whose options `make` derives from its parent's.
template <typename Options, typename ChildOptions>
ChildBinding<Options> child(std::string attribute, ChildOptions (*make)(const Options&)) {
  return {std::move(attribute), [make](const Options& o) { return options_to_python(make(o)); }};
}

/// Registers layer `name`, whose options are `Options`, checked by `check`, made of `children`.
template <typename Options>
void bind_layer(const std::string& name,
                void (*check)(const Options&),
                std::vector<ChildBinding<Options>> children = {}) {
  auto& binding = layer_bindings()[name];
  binding.declared = options::declaration<Options>();
  binding.check = [name, check](const pybind11::dict& d) {
    const Options given = options_from_python<Options>(d, name);
    pybind11::gil_scoped_release no_gil;  // the check communicates
    check(given);
  };
  binding.children = [name, children](const pybind11::dict& d) {
    const Options given = options_from_python<Options>(d, name);
    pybind11::dict out;
    for (const auto& c : children) {
      out[c.attribute.c_str()] = c.options(given);
    }
    return out;
  };
}

/// Defines declared_options, check_options, child_options and declared_layers on `m`
/// (bindings.cpp).
void bind_layer_declarations(pybind11::module_& m);

}  // namespace torch_mp::python
