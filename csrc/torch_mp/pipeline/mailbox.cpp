// Sends and receives by route, under the tags and stamp of the running step (mailbox.h).

#include "torch_mp/pipeline/mailbox.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "torch_mp/comm.h"

namespace torch_mp::pipeline {
namespace {

// Pipelines this process has built (see Mailbox::stamp).
std::atomic<int64_t> pipelines_built{0};

// Gloo tags are 31-bit; each (pipeline, step) gets its own range of them while they last.
constexpr int64_t kMaxTag = std::numeric_limits<int32_t>::max();

}  // namespace

Tags Mailbox::tags(int64_t message) const {
  if (ordered) {
    return Tags::ordered();
  }
  const int64_t epochs = std::max<int64_t>(1, kMaxTag / kTagsPerMessage / messages_per_step);
  const int64_t epoch = (stamp.pipeline * 1000003 + stamp.step) % epochs;
  return {static_cast<int>((epoch * messages_per_step + message) * kTagsPerMessage), 1};
}

std::vector<c10::intrusive_ptr<c10d::Work>> Mailbox::send(const Route& route,
                                                          const std::vector<at::Tensor>& tensors) {
  return send_tensors(tensors,
                      route.peer,
                      tags(route.message),
                      group,
                      stamp_of(route.message),
                      send_channels[route.message]);
}

PendingRecv Mailbox::post(const Route& route) {
  return post_recv(route.peer, tags(route.message), group, device, recv_channels[route.message]);
}

std::vector<at::Tensor> Mailbox::finish(const Route& route,
                                        PendingRecv& pending,
                                        const std::string& what) {
  return finish_recv(
      pending, group, device, stamp_of(route.message), what, recv_channels[route.message]);
}

std::vector<c10::intrusive_ptr<c10d::Work>> Mailbox::send_failure(const Route& route,
                                                                  const PeerFailure& failure) {
  return pipeline::send_failure(failure,
                                route.peer,
                                tags(route.message),
                                group,
                                stamp_of(route.message),
                                send_channels[route.message],
                                device);
}

void Mailbox::agree_on_pipeline_id() {
  stamp.pipeline = comm::all_reduce(at::scalar_tensor(pipelines_built.load(),
                                                      at::TensorOptions(at::kLong).device(device)),
                                    group,
                                    c10d::ReduceOp::MAX)
                       .item<int64_t>();
  pipelines_built = stamp.pipeline + 1;
}

void Mailbox::start_over() {
  send_channels.clear();
  recv_channels.clear();
  agree_on_pipeline_id();
  stamp.step = 0;
}

}  // namespace torch_mp::pipeline
