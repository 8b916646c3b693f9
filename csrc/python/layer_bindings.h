#pragma once
// The layers' declared options (torch_mp/options.h) as Python reads them:
//
//   torch_mp._C.declared_options("ParallelMLP")
//       -> [(name, kind, type, default), ...] in declaration order
//   torch_mp._C.check_options("ParallelMLP", {"hidden_size": 8, ..., "group": "<name>"})
//       the layer's construction-time check (sizes, agreement across ranks)
//
// Each bindings file registers its layers with bind_layer<Options>(name, check); torch_mp's
// Python modules derive their constructor, forward call and from_dense from the declaration.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "torch_mp/operator_options.h"

namespace torch_mp::python {

/// What Python needs of one layer's declaration.
struct LayerBinding {
  std::vector<options::Declared> declared;
  /// Runs the layer's check on options given by name (groups by name).
  std::function<void(const pybind11::dict&)> check;
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

/// Registers layer `name`, whose options are `Options`, checked by `check`.
template <typename Options>
void bind_layer(const std::string& name, void (*check)(const Options&)) {
  layer_bindings()[name] = {options::declaration<Options>(),
                            [name, check](const pybind11::dict& d) {
                              const Options given = options_from_python<Options>(d, name);
                              pybind11::gil_scoped_release no_gil;  // the check communicates
                              check(given);
                            }};
}

/// Defines declared_options and check_options on `m` (bindings.cpp).
void bind_layer_declarations(pybind11::module_& m);

}  // namespace torch_mp::python
