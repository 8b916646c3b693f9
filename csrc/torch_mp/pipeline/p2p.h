#pragma once
// Point-to-point exchange of tensor lists between pipeline ranks, shapes and dtypes included.
//
// Every message is preceded by a small metadata message (count, dtype, shape of each tensor),
// so receivers allocate exactly what arrives, whatever the stage emits and however it changes
// from one micro-batch or step to the next. Sends are asynchronous (wait on the returned works
// before the tensors are reused); receives block. Gloo has no coalesced P2P, so every tensor is
// its own message under its own tag.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::pipeline {

/// At most this many tensors pass between two stages in one message.
constexpr int64_t kMaxTensorsPerMessage = 32;
/// Tags one message uses: [tag, tag + kTagsPerMessage).
constexpr int kTagsPerMessage = kMaxTensorsPerMessage + 1;

/// What a message belongs to: the pipeline instance and step that sent it, so that a message
/// left over from an earlier (failed) step or another Pipeline is never taken for a new one.
struct MessageStamp {
  int64_t pipeline = 0;
  int64_t step = 0;
};

/// Sends `tensors` (made contiguous) to rank `peer` of `group` under tags starting at `tag`,
/// stamped with `stamp`. Returns the pending works.
std::vector<c10::intrusive_ptr<c10d::Work>> send_tensors(const std::vector<at::Tensor>& tensors,
                                                         int peer,
                                                         int tag,
                                                         const GroupPtr& group,
                                                         MessageStamp stamp);

/// A receive whose metadata message is posted ahead (`post_recv`), to be finished when its
/// tensors are needed (`finish_recv`): the metadata can arrive while the receiver computes, and
/// only the data message is then on the critical path.
struct PendingRecv {
  int peer = 0;
  int tag = 0;
  std::vector<at::Tensor> metadata;
  c10::intrusive_ptr<c10d::Work> work;
};

/// Posts the metadata receive of the message `peer` sends under `tag`.
PendingRecv post_recv(int peer, int tag, const GroupPtr& group, at::Device device);

/// Waits for `pending`'s metadata, then receives the tensors; checks as recv_tensors does.
std::vector<at::Tensor> finish_recv(PendingRecv& pending,
                                    const GroupPtr& group,
                                    at::Device device,
                                    MessageStamp expected,
                                    const std::string& what);

/// Receives what `send_tensors` sent from `peer` under `tag`, allocated on `device`. Raises if
/// the metadata is malformed (a sender that is not a torch_mp pipeline stage) or carries another
/// stamp than `expected` (a message of another step or Pipeline); `what` names the receive.
std::vector<at::Tensor> recv_tensors(int peer,
                                     int tag,
                                     const GroupPtr& group,
                                     at::Device device,
                                     MessageStamp expected,
                                     const std::string& what);

}  // namespace torch_mp::pipeline
