#include "torch_mp/live_storages.h"

#include <c10/util/Exception.h>

#include <unordered_set>

namespace torch_mp {

namespace {

// `t`'s storage, or none where it has none a caller could reach (a wrapper subclass's).
c10::Storage storage_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return {};
  }
  try {
    return t.storage();
  } catch (const c10::Error&) {
    return {};
  }
}

}  // namespace

int64_t LiveStorages::add(const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs) {
  std::unordered_set<const c10::StorageImpl*> seen;
  for (const auto& t : inputs) {
    seen.insert(storage_of(t).unsafeGetStorageImpl());
  }
  for (const auto& t : outputs) {
    const auto storage = storage_of(t);
    const auto* key = storage.unsafeGetStorageImpl();
    if (!key || seen.count(key)) {
      continue;
    }
    const auto it = live_.find(key);
    if (it != live_.end() && !it->second.expired()) {
      continue;  // (counted already)
    }
    live_.insert_or_assign(key, storage.getWeakStorageImpl());  // (a dead one's address reused)
  }
  return bytes();
}

int64_t LiveStorages::bytes() {
  int64_t total = 0;
  for (auto it = live_.begin(); it != live_.end();) {
    auto storage = it->second.lock();
    if (!storage) {
      it = live_.erase(it);
      continue;
    }
    total += static_cast<int64_t>(storage->nbytes());
    ++it;
  }
  return total;
}

}  // namespace torch_mp
