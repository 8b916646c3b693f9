#pragma once
// What every bindings file of torch_mp._C shares.
//
// How groups cross from Python: the Python side passes `group.group_name`, and we look the
// group up in c10d's group registry (torch.distributed registers every group it makes there).
// Passing names rather than pybind11-wrapped ProcessGroup objects keeps this module independent
// of torch's pybind11 type registrations and lets the ops become TORCH_LIBRARY operators (which
// take only strings and tensors) for torch.compile later.

#include <pybind11/pybind11.h>

#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "torch_mp/process_groups.h"

namespace torch_mp::python {

// Everything that communicates waits without the GIL: c10d's worker threads may need it (to free
// tensors that Python owns) before the collective can finish, and would deadlock against a
// caller that held it.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

inline GroupPtr resolve(const std::string& group_name) {
  return c10d::resolve_process_group(group_name);
}

}  // namespace torch_mp::python
