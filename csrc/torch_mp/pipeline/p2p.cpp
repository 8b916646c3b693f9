#include "torch_mp/pipeline/p2p.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace torch_mp::pipeline {
namespace {

// Metadata layout (int64): [pipeline, step, count, then per tensor: dtype, ndim, size_0 ..
// size_{ndim-1}].
constexpr int64_t kMaxDims = 8;
constexpr int64_t kMetadataLength = 3 + kMaxTensorsPerMessage * (2 + kMaxDims);

at::Tensor encode(const std::vector<at::Tensor>& tensors, MessageStamp stamp) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) <= kMaxTensorsPerMessage,
              "torch_mp.pipeline: a stage passes ",
              tensors.size(),
              " tensors to the next; at most ",
              kMaxTensorsPerMessage,
              " are supported");
  auto metadata = at::zeros({kMetadataLength}, at::kLong);
  auto* out = metadata.data_ptr<int64_t>();
  int64_t i = 0;
  out[i++] = stamp.pipeline;
  out[i++] = stamp.step;
  out[i++] = static_cast<int64_t>(tensors.size());
  for (const auto& t : tensors) {
    TORCH_CHECK(t.dim() <= kMaxDims,
                "torch_mp.pipeline: tensors passed between stages have at most ",
                kMaxDims,
                " dims, got ",
                t.dim());
    out[i++] = static_cast<int64_t>(t.scalar_type());
    out[i++] = t.dim();
    for (int64_t d = 0; d < t.dim(); ++d) {
      out[i++] = t.size(d);
    }
  }
  return metadata;
}

std::vector<at::Tensor> allocate(const at::Tensor& metadata,
                                 at::Device device,
                                 MessageStamp expected,
                                 const std::string& what) {
  const auto* in = metadata.data_ptr<int64_t>();
  int64_t i = 0;
  const MessageStamp got{in[0], in[1]};
  i = 2;
  TORCH_CHECK(got.pipeline == expected.pipeline && got.step == expected.step,
              "torch_mp.pipeline: ",
              what,
              " received a message sent in step ",
              got.step,
              " of pipeline ",
              got.pipeline,
              " while running step ",
              expected.step,
              " of pipeline ",
              expected.pipeline,
              " (a message left over from another step); refused");
  const int64_t count = in[i++];
  TORCH_CHECK(count >= 0 && count <= kMaxTensorsPerMessage,
              "torch_mp.pipeline: received malformed tensor metadata (count ",
              count,
              ")");
  std::vector<at::Tensor> tensors;
  for (int64_t n = 0; n < count; ++n) {
    const auto dtype = static_cast<at::ScalarType>(in[i++]);
    const int64_t ndim = in[i++];
    TORCH_CHECK(ndim >= 0 && ndim <= kMaxDims, "torch_mp.pipeline: malformed tensor metadata");
    std::vector<int64_t> shape(in + i, in + i + ndim);
    i += ndim;
    tensors.push_back(at::empty(shape, at::TensorOptions().dtype(dtype).device(device)));
  }
  return tensors;
}

}  // namespace

std::vector<c10::intrusive_ptr<c10d::Work>> send_tensors(const std::vector<at::Tensor>& tensors,
                                                         int peer,
                                                         int tag,
                                                         const GroupPtr& group,
                                                         MessageStamp stamp) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  const at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
  std::vector<at::Tensor> metadata{encode(tensors, stamp).to(device)};
  works.push_back(group->send(metadata, peer, tag));
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<at::Tensor> one{tensors[i].detach().contiguous()};
    works.push_back(group->send(one, peer, tag + 1 + static_cast<int>(i)));
  }
  return works;
}

PendingRecv post_recv(int peer, int tag, const GroupPtr& group, at::Device device) {
  PendingRecv pending{
      peer, tag, {at::empty({kMetadataLength}, at::TensorOptions(at::kLong).device(device))}, {}};
  pending.work = group->recv(pending.metadata, peer, tag);
  return pending;
}

std::vector<at::Tensor> finish_recv(PendingRecv& pending,
                                    const GroupPtr& group,
                                    at::Device device,
                                    MessageStamp expected,
                                    const std::string& what) {
  pending.work->wait();
  auto tensors = allocate(pending.metadata[0].cpu(), device, expected, what);
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<at::Tensor> one{tensors[i]};
    group->recv(one, pending.peer, pending.tag + 1 + static_cast<int>(i))->wait();
  }
  return tensors;
}

std::vector<at::Tensor> recv_tensors(int peer,
                                     int tag,
                                     const GroupPtr& group,
                                     at::Device device,
                                     MessageStamp expected,
                                     const std::string& what) {
  auto pending = post_recv(peer, tag, group, device);
  return finish_recv(pending, group, device, expected, what);
}

}  // namespace torch_mp::pipeline
