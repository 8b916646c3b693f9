#include "torch_mp/data_parallel/owners.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace torch_mp::data_parallel {
namespace {

std::mutex owners_mutex;
// Keyed by the parameter's TensorImpl, which set_data (the flat buckets, ZeRO-3) keeps: every
// owner holds its parameters, so no key outlives its tensor while it is in the map.
std::unordered_map<const c10::TensorImpl*, Owners>& owners() {
  static std::unordered_map<const c10::TensorImpl*, Owners> map;
  return map;
}
// Entries with gathers: a forward's wait_for_gathers looks nothing up while there are none.
std::atomic<size_t> gathering{0};

}  // namespace

std::vector<Owners> owners_of(const std::vector<at::Tensor>& parameters) {
  std::vector<Owners> out(parameters.size());
  std::lock_guard<std::mutex> lock(owners_mutex);
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto found = owners().find(parameters[i].unsafeGetTensorImpl());
    if (found != owners().end()) {
      out[i] = found->second;
    }
  }
  return out;
}

void change_owners(const std::vector<at::Tensor>& parameters,
                   const std::function<void(size_t, Owners&)>& change) {
  std::lock_guard<std::mutex> lock(owners_mutex);
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto key = parameters[i].unsafeGetTensorImpl();
    Owners owner = owners()[key];
    const bool had_gathers = owner.gathers != nullptr;
    try {
      change(i, owner);
    } catch (...) {
      if (owners()[key].empty()) {
        owners().erase(key);
      }
      throw;
    }
    if (had_gathers != (owner.gathers != nullptr)) {
      had_gathers ? --gathering : ++gathering;
    }
    if (owner.empty()) {
      owners().erase(key);
    } else {
      owners()[key] = std::move(owner);
    }
  }
}

void wait_for_gathers(const std::vector<at::Tensor>& parameters) {
  if (gathering == 0) {
    return;
  }
  // Waited for outside the map's lock: a wait may take long, and another thread may need the map.
  for (const Owners& owner : owners_of(parameters)) {
    if (owner.gathers != nullptr) {
      owner.gathers->wait_for_bucket(owner.bucket);
    }
  }
}

}  // namespace torch_mp::data_parallel
