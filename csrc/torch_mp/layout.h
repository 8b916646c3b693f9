#pragma once
// How a parameter is laid out over the mesh (docs/design.md §5.2): sharded along a dim over a
// group, or replicated over it. Norms, clipping and checkpoints read the layout instead of guessing
// from module classes.
//
// Layouts live in a registry keyed by the parameter's TensorImpl, so both front ends see them:
// the C++ modules register theirs in reset(), the Python modules theirs whenever their
// parameters are (re)created. The registry holds weak references: it keeps no tensor alive, and
// a TensorImpl's address cannot be reused while an entry for it exists.

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp {

/// The layout of one parameter.
struct ParameterLayout {
  /// The dense tensor's dim that is split across `group` (chunk `rank` on each rank); nullopt
  /// when every rank of `group` holds the whole tensor.
  std::optional<int64_t> shard_dim;
  /// The group the parameter is sharded or replicated over (the tensor-parallel group).
  GroupPtr group;
  /// A copy of a parameter that another pipeline stage holds too (the output head tied to the
  /// input embedding): its gradient is summed with the original's, and norms count it once.
  bool tied_copy = false;
  /// How many equal parts the sharded dim holds, each split over `group` on its own: 3 for a
  /// fused Q/K/V weight, whose local rows are this rank's rows of Q, then of K, then of V.
  int64_t parts = 1;
  /// The dense tensor's size along `shard_dim`, when the shards are padded past it (a vocabulary
  /// not divisible by the group: the last ranks' rows past it are padding); nullopt: the shards
  /// tile it exactly (parts * group size * local size / parts).
  std::optional<int64_t> dense_size = std::nullopt;

  bool is_sharded() const { return shard_dim.has_value(); }
};

/// Records the layout of `parameter` (replacing an earlier one).
void set_layout(const at::Tensor& parameter, ParameterLayout layout);

/// Records that `parameter` is sharded along `dim` over `group`.
void set_sharded(const at::Tensor& parameter, int64_t dim, const GroupPtr& group);

/// Records that `parameter` is replicated over `group`.
void set_replicated(const at::Tensor& parameter, const GroupPtr& group);

/// The layout of a column (`shard_dim` 0) or row (`shard_dim` 1) parallel layer's weight and
/// bias: the weight sharded along `shard_dim`; the bias (if defined) sharded along 0 with a
/// column layer's output, replicated after a row layer's reduction.
void set_weight_and_bias_layout(const at::Tensor& weight,
                                const at::Tensor& bias,
                                int64_t shard_dim,
                                const GroupPtr& group);

/// Marks `parameter` as the tied copy of a parameter held by another stage (see
/// ParameterLayout::tied_copy), keeping the rest of its layout.
void mark_tied_copy(const at::Tensor& parameter, const GroupPtr& default_group);

/// The layout recorded for `parameter`, or nullopt for a parameter no torch_mp layer made (those
/// are treated as replicated over the tensor-parallel group).
std::optional<ParameterLayout> layout_of(const at::Tensor& parameter);

}  // namespace torch_mp
