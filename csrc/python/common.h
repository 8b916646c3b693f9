#pragma once
// What every bindings file of torch_mp._C shares.
//
// How groups cross from Python: the Python side passes `group.group_name`, and we look the
// group up in c10d's group registry (torch.distributed registers every group it makes there).
// Names rather than pybind11-wrapped ProcessGroup objects keep this module independent of
// torch's pybind11 type registrations, and they are what the core's PyTorch operators
// (torch.ops.torch_mp.*) take, as PyTorch's functional collectives do.

#include <pybind11/pybind11.h>

#include <string>
#include <type_traits>

#include "torch_mp/process_groups.h"

namespace torch_mp::python {

// Everything that communicates waits without the GIL: c10d's worker threads may need it (to free
// tensors that Python owns) before the collective can finish, and would deadlock against a
// caller that held it.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

inline GroupPtr resolve(const std::string& group_name) { return group_named(group_name); }

namespace detail {

// How one parameter of a core function is taken from Python: by value, except that a process
// group is taken by name.
template <typename T>
struct FromPython {
  using type = std::decay_t<T>;
  static type& convert(type& value) { return value; }
};

template <>
struct FromPython<const GroupPtr&> {
  using type = std::string;
  static GroupPtr convert(const std::string& name) { return resolve(name); }
};

}  // namespace detail

/// `function` with each process-group parameter taken by name, as Python passes groups:
/// m.def("unshard", by_group_name(&tensor_parallel::unshard), py::arg(...), ...).
template <typename Result, typename... Args>
auto by_group_name(Result (*function)(Args...)) {
  return [function](typename detail::FromPython<Args>::type... args) -> Result {
    return function(detail::FromPython<Args>::convert(args)...);
  };
}

}  // namespace torch_mp::python
