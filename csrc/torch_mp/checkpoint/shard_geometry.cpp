// Which blocks of which dense tensors a rank holds (shard_geometry.h).

#include "torch_mp/checkpoint/shard_geometry.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "torch_mp/layout.h"

namespace torch_mp::checkpoint {

std::vector<Shard::Block> Shard::blocks() const {
  if (!dim) {
    return {Block{0, 0, tensor.dim() ? tensor.size(0) : 1}};
  }
  const int64_t local = tensor.size(*dim) / parts;
  const int64_t dense = dense_size.value_or(local * ranks * parts) / parts;
  std::vector<Block> out;
  for (int64_t k = 0; k < parts; ++k) {
    const int64_t begin = rank * local;
    const int64_t length = std::min(local, dense - begin);
    if (length > 0) {
      out.push_back(Block{k * local, k * dense + begin, length});
    }
  }
  return out;
}

std::vector<int64_t> Shard::dense_shape() const {
  auto shape = tensor.sizes().vec();
  if (dim) {
    shape[*dim] = dense_size.value_or(shape[*dim] * ranks);
  }
  return shape;
}

Shard shard_of(std::string name,
               const at::Tensor& tensor,
               const at::Tensor& parameter,
               const GroupPtr& default_group) {
  Shard shard{std::move(name), tensor};
  const auto layout = layout_of(parameter);
  const GroupPtr group = layout && layout->group ? layout->group : default_group;
  if (group) {
    shard.rank = group->getRank();
    shard.ranks = group->getSize();
  }
  if (layout && layout->shard_dim) {
    shard.dim = layout->shard_dim;
    shard.parts = layout->parts;
    shard.dense_size = layout->dense_size;
  }
  return shard;
}

std::string block_key(const std::string& name, std::optional<int64_t> dim, int64_t start) {
  return dim ? name + "@" + std::to_string(*dim) + ":" + std::to_string(start) : name;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) {
      out += ',';
    }
    out += std::to_string(shape[i]);
  }
  return out;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& where) {
  std::vector<int64_t> shape;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      shape.push_back(std::stoll(item));
    } catch (const std::exception&) {
      TORCH_CHECK(false, where, ": malformed dense shape '", text, "'");
    }
  }
  return shape;
}

Box::Box(const std::vector<int64_t>& shape,
         std::optional<int64_t> dim,
         int64_t start,
         int64_t length)
    : lo(shape.size(), 0), hi(shape) {
  if (dim) {
    lo[*dim] = start;
    hi[*dim] = start + length;
  }
}

int64_t Box::volume() const {
  int64_t v = 1;
  for (size_t d = 0; d < lo.size(); ++d) {
    v *= std::max<int64_t>(0, hi[d] - lo[d]);
  }
  return v;
}

Box Box::intersect(const Box& other) const {
  Box out = *this;
  for (size_t d = 0; d < lo.size(); ++d) {
    out.lo[d] = std::max(lo[d], other.lo[d]);
    out.hi[d] = std::min(hi[d], other.hi[d]);
  }
  return out;
}

at::Tensor Box::cut(at::Tensor tensor, const Box& part, const std::vector<int64_t>& origin) const {
  for (size_t d = 0; d < lo.size(); ++d) {
    tensor = tensor.narrow(
        static_cast<int64_t>(d), part.lo[d] - lo[d] + origin[d], part.hi[d] - part.lo[d]);
  }
  return tensor;
}

std::vector<std::pair<Box, std::vector<int64_t>>> boxes_of(const Shard& shard) {
  const auto shape = shard.dense_shape();
  std::vector<std::pair<Box, std::vector<int64_t>>> out;
  for (const auto& block : shard.blocks()) {
    std::vector<int64_t> origin(shape.size(), 0);
    if (shard.dim) {
      origin[*shard.dim] = block.local_begin;
    }
    out.emplace_back(Box(shape, shard.dim, block.dense_begin, block.length), origin);
  }
  return out;
}

bool over_expert_group(const at::Tensor& parameter, const GroupPtr& ep_group) {
  const auto layout = layout_of(parameter);
  return ep_group && ep_group->getSize() > 1 && layout && layout->group == ep_group;
}

}  // namespace torch_mp::checkpoint
