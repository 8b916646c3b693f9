#include "torch_mp/layout.h"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>

namespace torch_mp {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  std::optional<int64_t> shard_dim;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  bool tied_copy = false;
  int64_t parts = 1;
  std::optional<int64_t> dense_size = std::nullopt;
};

std::mutex registry_mutex;
// Keyed by TensorImpl address; the weak reference in the entry keeps the address from being
// reused by another tensor until the entry is dropped.
std::unordered_map<const c10::TensorImpl*, Entry>& registry() {
  static auto* entries = new std::unordered_map<const c10::TensorImpl*, Entry>();
  return *entries;
}

void drop_expired_locked() {
  std::erase_if(registry(), [](const auto& item) { return item.second.tensor.expired(); });
}

}  // namespace

void set_layout(const at::Tensor& parameter, ParameterLayout layout) {
  TORCH_CHECK(parameter.defined(), "torch_mp.set_layout: the parameter is undefined");
  TORCH_CHECK(!layout.shard_dim || (*layout.shard_dim >= 0 && *layout.shard_dim < parameter.dim()),
              "torch_mp.set_layout: shard dim ",
              layout.shard_dim.value_or(-1),
              " is out of range for a parameter of shape ",
              parameter.sizes());
  TORCH_CHECK(layout.parts >= 1 &&
                  (!layout.shard_dim || parameter.size(*layout.shard_dim) % layout.parts == 0),
              "torch_mp.set_layout: ",
              layout.parts,
              " parts do not divide a parameter of shape ",
              parameter.sizes());
  std::lock_guard<std::mutex> lock(registry_mutex);
  static size_t inserts = 0;
  if (++inserts % 1024 == 0) {
    drop_expired_locked();
  }
  c10::TensorImpl* impl = parameter.unsafeGetTensorImpl();
  registry().insert_or_assign(
      impl,
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(parameter.getIntrusivePtr()),
            layout.shard_dim,
            c10::weak_intrusive_ptr<c10d::ProcessGroup>(layout.group),
            layout.tied_copy,
            layout.parts,
            layout.dense_size});
}

void set_sharded(const at::Tensor& parameter, int64_t dim, const GroupPtr& group) {
  set_layout(parameter, ParameterLayout{dim, group});
}

void set_replicated(const at::Tensor& parameter, const GroupPtr& group) {
  set_layout(parameter, ParameterLayout{std::nullopt, group});
}

void set_weight_and_bias_layout(const at::Tensor& weight,
                                const at::Tensor& bias,
                                int64_t shard_dim,
                                const GroupPtr& group) {
  set_sharded(weight, shard_dim, group);
  if (bias.defined()) {
    shard_dim == 0 ? set_sharded(bias, 0, group) : set_replicated(bias, group);
  }
}

void mark_tied_copy(const at::Tensor& parameter, const GroupPtr& default_group) {
  auto layout = layout_of(parameter).value_or(ParameterLayout{std::nullopt, default_group});
  layout.tied_copy = true;
  set_layout(parameter, std::move(layout));
}

std::optional<ParameterLayout> layout_of(const at::Tensor& parameter) {
  if (!parameter.defined()) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry().find(parameter.unsafeGetTensorImpl());
  if (it == registry().end() || it->second.tensor.expired()) {
    return std::nullopt;
  }
  const Entry& e = it->second;
  return ParameterLayout{e.shard_dim, e.group.lock(), e.tied_copy, e.parts, e.dense_size};
}

}  // namespace torch_mp
