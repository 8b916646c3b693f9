#pragma once
// Point-to-point exchange of tensor lists between pipeline ranks, shapes and dtypes included.
//
// Every message is preceded by a small metadata message (count, dtype, shape of each tensor),
// so receivers allocate exactly what arrives, whatever the stage emits and however it changes
// from one micro-batch or step to the next. Sends are asynchronous (wait on the returned works
// before the tensors are reused); receives block. Gloo has no coalesced P2P, so every tensor is
// its own message under its own tag.

#include <ATen/core/Tensor.h>

#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::pipeline {

/// At most this many tensors pass between two stages in one message.
constexpr int64_t kMaxTensorsPerMessage = 32;
/// Tags one message uses: [tag, tag + kTagsPerMessage).
constexpr int kTagsPerMessage = kMaxTensorsPerMessage + 1;

/// Sends `tensors` (made contiguous) to rank `peer` of `group` under tags starting at `tag`.
/// Returns the pending works.
std::vector<c10::intrusive_ptr<c10d::Work>> send_tensors(const std::vector<at::Tensor>& tensors,
                                                         int peer,
                                                         int tag,
                                                         const GroupPtr& group);

/// Receives what `send_tensors` sent from `peer` under `tag`, allocated on `device`.
/// Raises if the metadata is malformed (a sender that is not a torch_mp pipeline stage).
std::vector<at::Tensor> recv_tensors(int peer, int tag, const GroupPtr& group, at::Device device);

}  // namespace torch_mp::pipeline
