#pragma once
// Plain (not differentiable) collectives over a c10d process group: the pieces the autograd
// collectives (collectives.h) and the layers are made of. Each returns a new tensor and leaves
// its input untouched, waits for the collective, and turns a dead or silent peer into an error
// that says so.
//
// They are also PyTorch operators, groups passed by name (process_groups.h: group_name) as
// PyTorch's functional collectives take them, each with a meta kernel that gives its output's
// shape without communicating, so torch.compile traces through them:
//
//   torch.ops.torch_mp.all_reduce(Tensor x, str reduce_op, str group) -> Tensor   "sum" | "max"
//   torch.ops.torch_mp.all_gather(Tensor x, int dim, str group) -> Tensor
//   torch.ops.torch_mp.reduce_scatter(Tensor x, int dim, str group) -> Tensor
//   torch.ops.torch_mp.split(Tensor x, int dim, str group) -> Tensor    this rank's chunk

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::comm {

/// Sum (or the reduction `op`, e.g. c10d::ReduceOp::MAX) of `x` over the group.
at::Tensor all_reduce(const at::Tensor& x,
                      const GroupPtr& group,
                      c10d::ReduceOp op = c10d::ReduceOp::SUM);

/// The group's tensors concatenated along `dim`, in rank order.
at::Tensor all_gather(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// Writes the group's `input`s into `output` (1-D, group size x input's elements), in rank
/// order: an all-gather without the concatenation's copy. `input` may be this rank's range of
/// `output` (in place).
void all_gather_into(const at::Tensor& output, const at::Tensor& input, const GroupPtr& group);
/// all_gather_into, started: `output` is complete once the returned work is waited for (wait).
c10::intrusive_ptr<c10d::Work> start_all_gather_into(const at::Tensor& output,
                                                     const at::Tensor& input,
                                                     const GroupPtr& group);

/// Every rank's `text` (any bytes), in rank order, on every rank: one all-reduce of the lengths
/// and one all-gather, on the group's device.
std::vector<std::string> all_gather_text(const std::string& text, const GroupPtr& group);

/// Returns once every rank of the group has called it (a dead or silent peer: an error).
void barrier(const GroupPtr& group);

/// The union of every rank's named tensors, on every rank (a name several ranks hold is taken
/// from the lowest of them), on the group's device: their names, dtypes and shapes exchanged
/// first, then each broadcast from its rank.
std::map<std::string, at::Tensor> all_gather_named(const std::map<std::string, at::Tensor>& mine,
                                                   const GroupPtr& group);

/// Waits for an asynchronous collective `op` on `group`, turning a dead or silent peer into an
/// error that says so.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupPtr& group, const char* op);

/// Sends and receives posted together, as batch_isend_irecv posts them. Under NCCL they form
/// one group (ncclGroupStart .. ncclGroupEnd, through the group's coalescing): two ranks that
/// send to each other then cannot each wait for a receive queued behind its own send. Elsewhere
/// (Gloo) they are posted one after the other, every one before any is waited for.
///
/// Under NCCL, comm::send and comm::recv on the group, while a P2PGroup of this thread is open,
/// only queue their operations (and return null works): `finish` posts them all in one group,
/// once every buffer is written, so that NCCL's stream, which waits for the compute stream when
/// the group starts, sees each one complete.
///
///   comm::P2PGroup batch(group);
///   auto send = comm::send(out, next, tag, group);   // null inside an NCCL group
///   auto recv = comm::recv(in, previous, tag, group);
///   batch.end(send, recv);                           // the group's work in place of each
class P2PGroup {
 public:
  explicit P2PGroup(GroupPtr group);
  P2PGroup(const P2PGroup&) = delete;
  P2PGroup& operator=(const P2PGroup&) = delete;
  /// Ends a group left open (an exception between its posts).
  ~P2PGroup();

  /// Ends the group. Under NCCL each operation's work is the group's: it replaces each of
  /// `works` (and the posted tensors must outlive it: take_tensors).
  template <typename... Works>
  void end(Works&... works) {
    const auto group_work = finish();
    if (group_work) {
      ((works = group_work), ...);
    }
  }
  /// Ends the group; its work under NCCL (null elsewhere: each operation has its own).
  c10::intrusive_ptr<c10d::Work> finish();
  /// Under NCCL, the tensors the group posted: the caller keeps them until its work completes
  /// (on the caching allocator's terms, a buffer freed earlier could be reused under NCCL).
  std::vector<at::Tensor> take_tensors() { return std::move(posted_); }

 private:
  friend c10::intrusive_ptr<c10d::Work> send(at::Tensor, int, int, const GroupPtr&);
  friend c10::intrusive_ptr<c10d::Work> recv(at::Tensor, int, int, const GroupPtr&);
  // comm::send (`is_send`) or comm::recv: queued in this thread's open group on `group`, posted
  // now otherwise.
  static c10::intrusive_ptr<c10d::Work> post(
      bool is_send, at::Tensor tensor, int peer, int tag, const GroupPtr& group);
  struct Op {
    bool send;
    at::Tensor tensor;
    int peer, tag;
  };
  GroupPtr group_;
  bool open_ = false;
  P2PGroup* enclosing_ = nullptr;  // the group open on this thread before this one
  std::vector<Op> ops_;
  std::vector<at::Tensor> posted_;
};

/// Sends `tensor` to rank `peer` of `group` under `tag` (queued in an open NCCL P2PGroup).
c10::intrusive_ptr<c10d::Work> send(at::Tensor tensor, int peer, int tag, const GroupPtr& group);
/// Receives into `tensor` from rank `peer` of `group` under `tag` (queued in an open NCCL
/// P2PGroup).
c10::intrusive_ptr<c10d::Work> recv(at::Tensor tensor, int peer, int tag, const GroupPtr& group);

/// This rank's chunk along `dim` of the sum of `x` over the group.
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const GroupPtr& group);

/// This rank's chunk of `x` along `dim` (a contiguous copy).
at::Tensor split(const at::Tensor& x, int64_t dim, const GroupPtr& group);

}  // namespace torch_mp::comm
