#include "torch_mp/process_groups.h"

// The torch wheel ships ProcessGroupGloo.hpp but not the Gloo headers it includes, so the build
// points this one file at a system copy of them (Debian's libgloo-dev). That copy is older than
// the Gloo inside torch; it is safe here because ProcessGroupGloo holds Gloo objects only behind
// pointers and this file calls nothing but torch's exported constructors and factories: no Gloo
// type is laid out or inlined in our code.
#ifdef TORCH_MP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

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

}  // namespace

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
    case Backend::kNccl:
      TORCH_CHECK(false,
                  "torch_mp: NCCL groups cannot be created from C++ in this build yet; "
                  "use the Python front end (torch.distributed) for CUDA tensors");
  }
  group->setGroupName(name);
  return group;
}

}  // namespace torch_mp
