#pragma once
// Which blocks of which dense tensors a rank holds.
//
// A tensor sharded along a dim holds, of each of its `parts` (3 for a fused Q/K/V weight), the
// rank's share of that part's rows; the last rank's share may run into padding (a vocabulary
// padded to a multiple of the ranks), which is no block. A fused Q/K/V weight of 6 rows per part
// over 2 ranks, as rank 1 holds it, is three blocks:
//
//   dense rows   0 1 2 [3 4 5] | 6 7 8 [9 10 11] | 12 13 14 [15 16 17]      q | k | v
//   local rows          0 1 2  |        3  4  5  |           6  7  8
//
// A block is stored under "<name>@<dim>:<first dense row>", a whole tensor under its name.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// One tensor of this rank's share of a model (a parameter, buffer or optimizer state), and
/// where it lies in the dense tensor of its name.
struct Shard {
  /// The dense model's name, with a kind prefix: "model/<name>" or "optim/<name>/<state>".
  std::string name;
  /// This rank's tensor: read when saving, written in place when loading.
  at::Tensor tensor;
  /// The dense dim it is a part of; nullopt: it is the whole tensor.
  std::optional<int64_t> dim = std::nullopt;
  /// Parts of `dim`, each split over the ranks on its own (3 for a fused Q/K/V weight).
  int64_t parts = 1;
  /// The dense size along `dim`; nullopt: the parts tile it exactly (no padding).
  std::optional<int64_t> dense_size = std::nullopt;
  /// This rank's place in the group the tensor is sharded or replicated over.
  int64_t rank = 0;
  /// The size of that group.
  int64_t ranks = 1;

  /// Rows [local_begin, local_begin + length) of `tensor` along `dim` are the dense tensor's
  /// rows [dense_begin, dense_begin + length).
  struct Block {
    /// Where the block starts in `tensor`, where in the dense tensor, and its rows.
    int64_t local_begin = 0;
    int64_t dense_begin = 0;
    int64_t length = 0;
  };
  /// Every block of this rank's tensor (none of its padding); one whole block when not sharded.
  std::vector<Block> blocks() const;
  /// The dense tensor's shape.
  std::vector<int64_t> dense_shape() const;
};

/// Whether `parameter` lies over the expert group `ep_group` (a mixture of experts' experts or
/// router): tensors that differ between the data ranks of one (pp, tp) when the group has more
/// than one rank.
bool over_expert_group(const at::Tensor& parameter, const GroupPtr& ep_group);

/// A Shard named `name` of `tensor`, laid out as the layout recorded for `parameter` (itself, or
/// the parameter an optimizer state tensor belongs to; see torch_mp/layout.h): whole, replicated
/// over `default_group` (the tensor-parallel group), when none is recorded.
Shard shard_of(std::string name,
               const at::Tensor& tensor,
               const at::Tensor& parameter,
               const GroupPtr& default_group);

/// "<name>@<dim>:<start>" for the block of a sharded tensor starting at dense row `start`,
/// "<name>" for a whole one (no `dim`).
std::string block_key(const std::string& name, std::optional<int64_t> dim, int64_t start);

/// A dense shape as shard files' metadata gives it: "4,16".
std::string shape_text(const std::vector<int64_t>& shape);

/// Reads shape_text's form; raises "<where>: malformed dense shape '<text>'".
std::vector<int64_t> parse_shape(const std::string& text, const std::string& where);

/// A box in a dense tensor's coordinates: [lo[d], hi[d]) along every dim d.
struct Box {
  /// The first index inside, and the first past it, along every dim.
  std::vector<int64_t> lo, hi;

  /// The whole of `shape`, cut to [start, start + length) along `dim` if given.
  Box(const std::vector<int64_t>& shape, std::optional<int64_t> dim, int64_t start, int64_t length);
  /// The number of elements inside.
  int64_t volume() const;
  /// The box inside both (of volume 0 if they do not overlap).
  Box intersect(const Box& other) const;
  /// `tensor`, holding this box from `origin` on, cut to `part` (inside this box).
  at::Tensor cut(at::Tensor tensor, const Box& part, const std::vector<int64_t>& origin) const;
};

/// The boxes of the dense tensor that `shard` holds (one per block), with where each starts in
/// its tensor.
std::vector<std::pair<Box, std::vector<int64_t>>> boxes_of(const Shard& shard);

}  // namespace torch_mp::checkpoint
