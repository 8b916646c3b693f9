#pragma once
// The methods of context-parallel attention (attention.h), internal to the core. attention.cpp
// holds the operator (which picks a method) and the parts' check, gathered_attention.cpp the
// all_gather and all_to_all methods, ring_attention.cpp the ring with its kernels and autograd.
// Each method takes the public AttentionOptions, its scale resolved by scale_of.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "torch_mp/context_parallel/attention.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::context_parallel::detail {

inline constexpr const char* kWhat = "torch_mp.context_parallel.attention";

/// The scores' scale: `options.scale()`, or 1 / sqrt(d) when unset.
double scale_of(const at::Tensor& q, const AttentionOptions& options);

/// The parts' shapes, and the same on every rank (a rank with another length would leave the
/// others' collectives waiting, or mix parts of different sequences). Agreed before anything
/// is refused, so that every rank raises.
void check_parts(const at::Tensor& q,
                 const at::Tensor& k,
                 const at::Tensor& v,
                 const GroupPtr& group,
                 const AttentionOptions& options);

/// The positions this rank's part holds (sequence_positions), once check_parts has agreed the
/// parts' shapes: the operator torch_mp::context_part_positions, whose kernel runs the check
/// (so that compiled code checks them too).
at::Tensor checked_positions(const at::Tensor& q,
                             const at::Tensor& k,
                             const at::Tensor& v,
                             const GroupPtr& group,
                             const AttentionOptions& options);

/// K/V all-gathered; this rank's queries attend to all of them.
at::Tensor all_gather_attention(const at::Tensor& q,
                                const at::Tensor& k,
                                const at::Tensor& v,
                                const GroupPtr& group,
                                const AttentionOptions& options);

/// Ulysses: sequence-sharded to head-sharded and back by all-to-alls.
at::Tensor all_to_all_attention(const at::Tensor& q,
                                const at::Tensor& k,
                                const at::Tensor& v,
                                const GroupPtr& group,
                                const AttentionOptions& options);

/// The ring: the operator torch_mp::ring_attention (differentiable; causal masks only).
at::Tensor ring_attention(const at::Tensor& q,
                          const at::Tensor& k,
                          const at::Tensor& v,
                          const GroupPtr& group,
                          const AttentionOptions& options);

/// The operator `name`'s typed handle.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_named(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace torch_mp::context_parallel::detail
