#pragma once
// Point-to-point exchange of tensor lists between pipeline ranks, shapes and dtypes included.
//
// A message is one buffer: a header (the sending pipeline and step, and a flag) followed by
// every tensor's bytes. What the tensors are (count, dtypes, shapes) travels in a separate
// metadata message only when the receiver cannot know it: the first time a channel (one
// direction of one stage boundary for one micro-batch) is used, and when it changes. Both ends
// remember the layout last passed through each channel, so in the steady state a transfer is
// one message whose receive can be posted ahead, with no metadata round on the critical path:
//
//   first use:  metadata (tag)               + data (tag + 1)
//   same:                                      data (tag + 1)
//   changed:    marker of the old size (tag + 1) + metadata (tag) + data (tag + 2)
//   failed:     marker where the receiver waits (tag, or tag + 1) + what failed (tag + 3)
//
// Under NCCL's rules (Tags::ordered) every message between two ranks has the same tag and is
// matched in the order it is sent, which the order above keeps: each receive of a message is
// posted after the ones before it from the same peer. Every header and metadata message carries
// the number of the message it belongs to, so that a message that lands in a receive meant for
// another (two ranks whose orders differ) is refused, naming both, instead of read as data.
//
// A rank whose step fails sends a failure marker in place of every message it still owed, so
// that its peers, waiting for those messages, raise at once with its error instead of at the
// group's timeout, and pass it on in turn (send_failure, PeerFailure).
//
// Gloo moves an unbound buffer only once both ends have posted, so receives are posted early
// (post_recv) and finished when the tensors are needed (finish_recv). Sends are asynchronous.

#include <ATen/core/Tensor.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::pipeline {

/// At most this many tensors pass between two stages in one message.
constexpr int64_t kMaxTensorsPerMessage = 32;
/// Tags one message uses: [tag, tag + kTagsPerMessage).
constexpr int kTagsPerMessage = 4;

/// What a message belongs to: the pipeline instance and step that sent it, so that a message
/// left over from an earlier (failed) step or another Pipeline is never taken for a new one, and
/// its number in the step (message_of), so that one never lands in a receive meant for another.
struct MessageStamp {
  int64_t pipeline = 0;
  int64_t step = 0;
  int64_t message = 0;
};

/// The tags of one message's parts: part k under `first + stride * k`. Gloo's default gives each
/// part its own tag (stride 1); NCCL ignores tags, and a pipeline run under its rules uses one
/// tag for every message (`ordered`), so that Gloo, too, matches them by order alone.
struct Tags {
  int first = 0;
  int stride = 1;

  static Tags ordered() { return {0, 0}; }
  int operator()(int part) const { return first + stride * part; }
};

/// The dtypes and shapes of a message's tensors, as both ends of a channel remember them.
struct MessageLayout {
  std::vector<at::ScalarType> dtypes;
  std::vector<std::vector<int64_t>> shapes;

  static MessageLayout of(const std::vector<at::Tensor>& tensors);
  bool operator==(const MessageLayout& other) const = default;
  /// Bytes of the data message: header, then each tensor 64-byte aligned.
  int64_t packed_bytes() const;
};

/// What one end of a channel knows of it (empty until the first message passes).
struct Channel {
  std::optional<MessageLayout> layout;
};

/// Raised by finish_recv when the peer sent a failure marker instead of the message: another
/// rank's step failed. `what()` is that rank's error.
struct PeerFailure : std::runtime_error {
  PeerFailure(const std::string& message, int64_t origin, bool group_broken)
      : std::runtime_error(message), origin(origin), group_broken(group_broken) {}
  /// The rank (of the pipeline group) where the failure began.
  int64_t origin;
  /// Whether the failure left the group unusable (a timeout or a lost connection).
  bool group_broken;
};

/// Sends `tensors` to rank `peer` of `group` under `tags`, stamped with `stamp`; metadata only if
/// `channel` has not passed this layout last. Returns the pending works (null inside an NCCL
/// group: the group's work covers them, comm::P2PGroup).
std::vector<c10::intrusive_ptr<c10d::Work>> send_tensors(const std::vector<at::Tensor>& tensors,
                                                         int peer,
                                                         Tags tags,
                                                         const GroupPtr& group,
                                                         MessageStamp stamp,
                                                         Channel& channel);

/// Sends, in place of the message `channel` would carry under `tags`, a failure marker and
/// `failure` (the error, where it began and whether the group is still usable), so that the
/// receive waiting for it raises PeerFailure. Returns the pending works (keep them alive).
std::vector<c10::intrusive_ptr<c10d::Work>> send_failure(const PeerFailure& failure,
                                                         int peer,
                                                         Tags tags,
                                                         const GroupPtr& group,
                                                         MessageStamp stamp,
                                                         const Channel& channel,
                                                         at::Device device);

/// A receive posted ahead (`post_recv`), finished when its tensors are needed (`finish_recv`).
struct PendingRecv {
  int peer = 0;
  Tags tags;
  bool expects_data = false;  // the channel's layout is known: the data message is posted
  at::Tensor buffer;          // metadata or data, as posted
  c10::intrusive_ptr<c10d::Work> work;
};

/// Posts the receive of the message `peer` sends under `tags` through `channel`: its data
/// message if the channel's layout is known, its metadata message otherwise. (Its work is null
/// inside an NCCL group until the group's is put in its place.)
PendingRecv post_recv(
    int peer, Tags tags, const GroupPtr& group, at::Device device, const Channel& channel);

/// Waits for `pending` and returns the tensors (views of one received buffer), updating
/// `channel`. Raises PeerFailure if the peer sent a failure marker; raises if the metadata is
/// malformed (a sender that is not a torch_mp pipeline stage) or a header carries another stamp
/// than `expected` (a message of another step or Pipeline); `what` names the receive.
std::vector<at::Tensor> finish_recv(PendingRecv& pending,
                                    const GroupPtr& group,
                                    at::Device device,
                                    MessageStamp expected,
                                    const std::string& what,
                                    Channel& channel);

}  // namespace torch_mp::pipeline
