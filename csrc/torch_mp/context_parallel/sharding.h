#pragma once
// Context parallelism's sequence sharding: each rank of a context group holds a part of every
// sequence. Balanced for causal masks, the sequence is cut into 2 * cp chunks and rank r holds
// chunks r and 2cp - 1 - r (so each rank's queries see as many keys):
//
//   cp = 2, sequence of 8:   chunks [0 1] [2 3] [4 5] [6 7]
//                            rank 0 holds [0 1 6 7], rank 1 holds [2 3 4 5]
//
// Without load balancing rank r holds chunk r of cp. sequence_positions says which positions a
// rank holds, in its order: the rotary or learned positions of its tokens.
//
// Both functions are operators with autograd. Their backwards are the adjoints of the cut and
// of the join: the context ranks hold different parts of the data, and a model's replicated
// parameters have their gradients averaged over data x context ranks (DataParallel), so that
// they come out as one process's whether a rank's loss is over its part or over the joined
// sequence. (Not scatter_to_tp's and gather_from_tp's, whose ranks compute one thing.)
//
//   torch.ops.torch_mp.shard_sequence(Tensor x, int dim, str group, bool load_balance=True)
//     forward: this rank's part of the whole sequence (the same on every rank); backward: the
//     part's gradient in its place, zeros elsewhere (no communication)
//   torch.ops.torch_mp.unshard_sequence(Tensor x, int dim, str group, bool load_balance=True)
//     forward: the whole sequence from every rank's part; backward: the ranks' gradients of the
//     whole summed into each part (reduce-scatter)

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torch_mp/process_groups.h"

namespace torch_mp::context_parallel {

/// `group`, or the default mesh's context-parallel group when `group` is null.
GroupPtr cp_group_or_default(const GroupPtr& group);

/// The positions in a sequence of `sequence_length` that rank `rank` of a context group of
/// `size` ranks holds, in the order it holds them (int64). Raises unless the chunks (2 * size
/// with `load_balance`, else size) divide the sequence.
at::Tensor sequence_positions(int64_t sequence_length,
                              int64_t rank,
                              int64_t size,
                              bool load_balance = true);

/// The positions of the whole sequence in the order the ranks' parts are concatenated (rank 0's,
/// then rank 1's, ...): what an all-gather of the parts holds.
at::Tensor gathered_positions(int64_t sequence_length, int64_t size, bool load_balance = true);

/// This rank's part of `x` along `dim`, `x` being the whole sequence (the same on every rank of
/// `group`); the gradient goes back into the part's place. Raises, on every rank, if the ranks pass
/// different sequence lengths, or if the chunks do not divide the sequence.
at::Tensor shard_sequence(const at::Tensor& x,
                          int64_t dim,
                          const GroupPtr& group,
                          bool load_balance = true);

/// The whole sequence along `dim` from every rank's part `x` (as shard_sequence cut it); the
/// ranks' gradients of the whole are summed into each part.
at::Tensor unshard_sequence(const at::Tensor& x,
                            int64_t dim,
                            const GroupPtr& group,
                            bool load_balance = true);

}  // namespace torch_mp::context_parallel
