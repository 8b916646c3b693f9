#pragma once
// Moving tokens to their experts' ranks and back: rows of a tensor exchanged over an expert group
// with counts that differ from rank to rank (an all-to-all with variable splits).
//
//   torch.ops.torch_mp.all_to_all_rows(Tensor x, int[] send_counts, int[] recv_counts,
//       str group) -> Tensor
//     its backward sends the gradient's rows back the way they came (the counts swapped)

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::moe {

/// The rows of `x` [n, ...] sent over `group`: the first send_counts[0] to rank 0, the next
/// send_counts[1] to rank 1, and so on (they sum to n); returns the rows received, recv_counts[j]
/// of them from rank j, in rank order. The counts must be each pair's (exchange_counts gives
/// them).
at::Tensor all_to_all_rows(const at::Tensor& x,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts,
                           const GroupPtr& group);

/// Exchanges `counts` [ranks, m] (int64, on the CPU): row j goes to rank j; returns [ranks, m],
/// row j what rank j sent this rank. Raises on every rank if the ranks' m differ.
at::Tensor exchange_counts(const at::Tensor& counts, const GroupPtr& group);

}  // namespace torch_mp::moe
