#pragma once
// The tensor storages a piece of code made that are still alive, and their bytes: what
// torch_mp._memory.PeakMemory counts at the dispatcher, kept here so that the count after each
// operator walks a C++ table rather than Python objects.

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace torch_mp {

class LiveStorages {
 public:
  /// Counts the storages of `outputs` that are neither `inputs`' nor counted already (tensors
  /// without an accessible storage are left out) and returns bytes().
  int64_t add(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);

  /// The bytes of the counted storages still alive, each at its size of the moment (one resized
  /// to nothing counts nothing); the dead are dropped.
  int64_t bytes();

 private:
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> live_;
};

}  // namespace torch_mp
