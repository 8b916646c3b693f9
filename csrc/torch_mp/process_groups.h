#pragma once
// Creating c10d process groups from C++ (the Python front end gets its groups from
// torch.distributed instead).

#include <chrono>
#include <string>
#include <string_view>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace torch_mp {

/// A c10d process group, as every torch_mp function that communicates takes it.
using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
/// A c10d key-value store (TCPStore, HashStore, ...).
using StorePtr = c10::intrusive_ptr<c10d::Store>;

/// Communication backend of a process group.
enum class Backend {
  kGloo,  ///< CPU tensors
  kNccl,  ///< CUDA tensors
};

/// Parses "gloo" or "nccl"; raises on anything else.
Backend parse_backend(const std::string& name);

/// The backend for tensors on `device`: NCCL for CUDA, Gloo otherwise.
Backend default_backend(bool cuda);

/// Whether `group`'s default backend is NCCL (its tensors live on CUDA devices).
bool is_nccl(const GroupPtr& group);

/// Where the tensors `group` carries live: the current CUDA device for an NCCL group, the CPU
/// otherwise. Small exchanges of the core's own (counts, agreements, failure notices) are made
/// there, so that an NCCL group without a Gloo side (torch.distributed's "nccl") carries them.
at::Device device_of(const GroupPtr& group);

/// Whether this build can create NCCL groups (a CUDA build of torch, nccl.h found).
bool nccl_available();

/// Makes CUDA device `local_rank` (modulo the devices this process sees) the current one, as each
/// rank of an NCCL group needs its own; raises without NCCL or a device.
void use_local_cuda_device(int local_rank);

/// Creates a process group of `size` ranks in which this process has rank `rank`.
///
/// All members must call it with the same `store` contents: give each group its own store
/// (a c10d::PrefixStore over a shared one). `timeout` bounds every collective on the group, so a
/// dead or absent peer turns into an error instead of a hang. `name` names the group in c10d's
/// messages.
///
/// NCCL groups carry CUDA tensors, and CPU tensors over Gloo where Gloo is built in. Raises if
/// the backend was not compiled in (Gloo needs its headers at build time, NCCL a CUDA build of
/// torch and nccl.h). The group is registered in c10d's group registry (see group_name) under
/// `name` followed by a number that makes it unique in this process.
GroupPtr new_process_group(const StorePtr& store,
                           int rank,
                           int size,
                           Backend backend,
                           std::chrono::milliseconds timeout,
                           const std::string& name);

/// The name under which `group` is registered in c10d's group registry, registering it first if
/// it is not (an unnamed group gets a name of torch_mp's). The core's operators
/// (torch.ops.torch_mp.*) take groups by these names, as PyTorch's functional collectives do:
/// torch.distributed registers every group it makes, and so does new_process_group. Raises if
/// another live group holds the name.
std::string group_name(const GroupPtr& group);

/// The registered group named `name` (the inverse of group_name); raises naming it if there is
/// none.
GroupPtr group_named(std::string_view name);

/// group_named(name), or null for "": how the operators take an optional group (the context
/// group of a layer that may not be context-parallel, say).
GroupPtr group_named_or_none(std::string_view name);

}  // namespace torch_mp
