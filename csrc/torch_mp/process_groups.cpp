#include "torch_mp/process_groups.h"

// The torch wheel ships ProcessGroupGloo.hpp but not the Gloo headers it includes, so the build
// points this one file at a system copy of them (Debian's libgloo-dev). That copy is older than
// the Gloo inside torch; it is safe here because ProcessGroupGloo holds Gloo objects only behind
// pointers and this file calls nothing but torch's exported constructors and factories: no Gloo
// type is laid out or inlined in our code.
#ifdef TORCH_MP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
// NCCL groups need a CUDA build of torch and nccl.h (CMake finds the CUDA wheel's).
#ifdef TORCH_MP_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace torch_mp {

Backend parse_backend(const std::string& name) {
  if (name == "gloo") {
    return Backend::kGloo;
  }
  if (name == "nccl") {
    return Backend::kNccl;
  }
  TORCH_CHECK(false, "torch_mp: unknown backend '", name, "' (expected 'gloo' or 'nccl')");
}

Backend default_backend(bool cuda) { return cuda ? Backend::kNccl : Backend::kGloo; }

bool is_nccl(const GroupPtr& group) {
  return group->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
}

at::Device device_of(const GroupPtr& group) {
  return is_nccl(group) ? at::Device(at::kCUDA) : at::Device(at::kCPU);
}

namespace {

#ifdef TORCH_MP_WITH_GLOO
c10::intrusive_ptr<c10d::Backend> make_gloo(const StorePtr& store,
                                            int rank,
                                            int size,
                                            std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}
#endif

#ifdef TORCH_MP_WITH_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl(const StorePtr& store,
                                            int rank,
                                            int size,
                                            std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}
#endif

}  // namespace

bool nccl_available() {
#ifdef TORCH_MP_WITH_NCCL
  return true;
#else
  return false;
#endif
}

void use_local_cuda_device(int local_rank) {
#ifdef TORCH_MP_WITH_NCCL
  const int devices = static_cast<int>(c10::cuda::device_count());
  TORCH_CHECK(devices > 0, "torch_mp: an NCCL group needs a CUDA device; this process sees none");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank % devices));
#else
  TORCH_CHECK(false, "torch_mp was built without NCCL (a CUDA build of torch and nccl.h)");
#endif
}

GroupPtr new_process_group(const StorePtr& store,
                           int rank,
                           int size,
                           Backend backend,
                           std::chrono::milliseconds timeout,
                           const std::string& name) {
  TORCH_CHECK(size > 0 && rank >= 0 && rank < size,
              "torch_mp: rank ",
              rank,
              " is outside a process group of size ",
              size);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  switch (backend) {
    case Backend::kGloo: {
#ifdef TORCH_MP_WITH_GLOO
      auto gloo = make_gloo(store, rank, size, timeout);
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
      break;
#else
      TORCH_CHECK(
          false,
          "torch_mp was built without the Gloo headers, so it cannot create Gloo groups from C++ "
          "(install libgloo-dev and rebuild)");
#endif
    }
    case Backend::kNccl: {
#ifdef TORCH_MP_WITH_NCCL
      // CUDA tensors over NCCL; CPU tensors (the agreement checks, failure notices) over Gloo
      // when it is built in, as torch.distributed's "cpu:gloo,cuda:nccl".
      auto nccl =
          make_nccl(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, size, timeout);
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
#ifdef TORCH_MP_WITH_GLOO
      auto gloo =
          make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, size, timeout);
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
#endif
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
      break;
#else
      TORCH_CHECK(false,
                  "torch_mp was built without NCCL (it needs a CUDA build of torch and nccl.h), "
                  "so it cannot create NCCL groups from C++");
#endif
    }
  }
  static std::atomic<int64_t> groups_made{0};
  group->setGroupName(name + "#" + std::to_string(groups_made++));
  group_name(group);  // registers it
  return group;
}

namespace {

// The live group registered under `name`, or null (none, or one that has been destroyed).
GroupPtr registered(const std::string& name) {
  try {
    return c10d::resolve_process_group(name);
  } catch (const c10::Error&) {
    return {};
  }
}

}  // namespace

std::string group_name(const GroupPtr& group) {
  TORCH_CHECK(group, "torch_mp: no process group was given");
  std::string name = group->getGroupName();
  if (name.empty()) {
    static std::atomic<int64_t> unnamed{0};
    name = "torch_mp/unnamed#" + std::to_string(unnamed++);
    group->setGroupName(name);
  }
  const GroupPtr holder = registered(name);
  if (holder.get() == group.get()) {
    return name;
  }
  TORCH_CHECK(!holder,
              "torch_mp: two process groups are named '",
              name,
              "'; the core's operators find groups by name (give each its own)");
  c10d::unregister_process_group(name);  // a destroyed group's entry, if any
  c10d::register_process_group(name, group);
  return name;
}

GroupPtr group_named(std::string_view name) {
  return c10d::resolve_process_group(std::string(name));
}

GroupPtr group_named_or_none(std::string_view name) {
  return name.empty() ? nullptr : group_named(name);
}

}  // namespace torch_mp
