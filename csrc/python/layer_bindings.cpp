// torch_mp._C.declared_options, check_options, child_options and declared_layers: the layers'
// declared options, for the Python modules that derive their arguments from them (see
// layer_bindings.h).

#include "python/layer_bindings.h"

namespace py = pybind11;

namespace torch_mp::python {
namespace {

py::object to_python(const c10::IValue& value) {
  if (value.isNone()) {
    return py::none();
  }
  if (value.isBool()) {
    return py::bool_(value.toBool());
  }
  if (value.isInt()) {
    return py::int_(value.toInt());
  }
  if (value.isDouble()) {
    return py::float_(value.toDouble());
  }
  if (value.isIntList()) {  // a tuple, as torch.nn keeps sizes
    return py::tuple(py::cast(value.toIntVector()));
  }
  return py::str(value.toStringRef());
}

const LayerBinding& layer_named(const std::string& name) {
  const auto found = layer_bindings().find(name);
  if (found == layer_bindings().end()) {
    throw py::key_error("torch_mp: no layer declares its options as '" + name + "'");
  }
  return found->second;
}

}  // namespace

std::map<std::string, LayerBinding>& layer_bindings() {
  static std::map<std::string, LayerBinding> layers;
  return layers;
}

void bind_layer_declarations(py::module_& m) {
  m.def(
      "declared_options",
      [](const std::string& layer) {
        py::list out;
        for (const auto& d : layer_named(layer).declared) {
          out.append(py::make_tuple(d.name, d.kind, d.type, to_python(d.default_value)));
        }
        return out;
      },
      py::arg("layer"),
      "The options `layer` declares, in order: (name, kind, type, default) with kind "
      "'required', 'option' or 'keyword' and type a schema type or 'group'.");
  m.def(
      "check_options",
      [](const std::string& layer, const py::dict& options) { layer_named(layer).check(options); },
      py::arg("layer"),
      py::arg("options"),
      "Runs `layer`'s construction-time check on `options` (by name, groups by name).");
  m.def(
      "child_options",
      [](const std::string& layer, const py::dict& options) {
        return layer_named(layer).children(options);
      },
      py::arg("layer"),
      py::arg("options"),
      "The options of the layers `layer` is made of, by attribute, from its own `options` (by "
      "name, groups by name).");
  m.def("declared_layers", [] {
    py::list names;
    for (const auto& [name, unused] : layer_bindings()) {
      names.append(name);
    }
    return names;
  });
}

}  // namespace torch_mp::python
