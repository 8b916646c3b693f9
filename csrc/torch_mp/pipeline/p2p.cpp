#include "torch_mp/pipeline/p2p.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "torch_mp/agreement.h"
#include "torch_mp/comm.h"

namespace torch_mp::pipeline {
namespace {

using comm::check_device;

// Metadata layout (int64): [pipeline, step, message, count, then per tensor: dtype, ndim,
// size_0 .. size_{ndim-1}].
constexpr int64_t kMaxDims = 8;
constexpr int64_t kStampLength = 3;
constexpr int64_t kCount = kStampLength;  // where the count sits
constexpr int64_t kMetadataLength = kStampLength + 1 + kMaxTensorsPerMessage * (2 + kMaxDims);

// Data message: a header of kHeaderBytes (int64: pipeline, step, message, flag), then the
// tensors, each starting at a multiple of kAlign bytes.
constexpr int64_t kAlign = 64;
constexpr int64_t kHeaderBytes = kAlign;
enum Flag : int64_t {
  kData = 1,     // the tensors follow, in the layout the channel last passed
  kChanged = 2,  // the layout changed: metadata (part 0) and data (part 2) follow
  kFailed = 3,   // the sender's step failed: what failed follows (part 3)
};
// A metadata message with this count is a failure marker.
constexpr int64_t kFailedCount = -1;
// What failed: int64 origin rank, int64 group broken, then the text (truncated to fit).
constexpr int64_t kFailureBytes = 4096;

int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int64_t nbytes(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t size : shape) {
    numel *= size;
  }
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

at::Tensor encode(const MessageLayout& layout, MessageStamp stamp) {
  auto metadata = at::zeros({kMetadataLength}, at::kLong);
  auto* out = metadata.data_ptr<int64_t>();
  int64_t i = 0;
  out[i++] = stamp.pipeline;
  out[i++] = stamp.step;
  out[i++] = stamp.message;
  out[i++] = static_cast<int64_t>(layout.dtypes.size());
  for (size_t n = 0; n < layout.dtypes.size(); ++n) {
    out[i++] = static_cast<int64_t>(layout.dtypes[n]);
    out[i++] = static_cast<int64_t>(layout.shapes[n].size());
    for (int64_t size : layout.shapes[n]) {
      out[i++] = size;
    }
  }
  return metadata;
}

MessageStamp stamp_in(const int64_t* in) { return {in[0], in[1], in[2]}; }

void check_stamp(MessageStamp got, MessageStamp expected, const std::string& what) {
  TORCH_CHECK(got.pipeline != expected.pipeline || got.step != expected.step ||
                  got.message == expected.message,
              "torch_mp.pipeline: ",
              what,
              " received message ",
              got.message,
              " where it expected message ",
              expected.message,
              " of the step: its sender's sends and this rank's receives come in different "
              "orders (NCCL, matching them by order alone, would have delivered it here too); "
              "refused");
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
}

// Receives what failed (sent by send_failure) and raises it as PeerFailure.
[[noreturn]] void raise_peer_failure(int peer,
                                     Tags tags,
                                     const GroupPtr& group,
                                     at::Device device) {
  std::vector<at::Tensor> one{
      at::empty({kFailureBytes}, at::TensorOptions(at::kByte).device(device))};
  group->recv(one, peer, tags(3))->wait();
  const auto buffer = one[0].cpu();
  const auto* bytes = buffer.data_ptr<uint8_t>();
  int64_t header[2];
  std::memcpy(header, bytes, sizeof(header));
  const auto* text = reinterpret_cast<const char*>(bytes + sizeof(header));
  throw PeerFailure(
      std::string(text, strnlen(text, kFailureBytes - sizeof(header))), header[0], header[1] != 0);
}

MessageLayout decode(const at::Tensor& metadata, MessageStamp expected, const std::string& what) {
  const auto* in = metadata.data_ptr<int64_t>();
  check_stamp(stamp_in(in), expected, what);
  int64_t i = kCount;
  const int64_t count = in[i++];
  TORCH_CHECK(count >= 0 && count <= kMaxTensorsPerMessage,
              "torch_mp.pipeline: received malformed tensor metadata (count ",
              count,
              ")");
  MessageLayout layout;
  for (int64_t n = 0; n < count; ++n) {
    const int64_t dtype = in[i++];
    const int64_t ndim = in[i++];
    TORCH_CHECK(dtype >= 0 && dtype < static_cast<int64_t>(at::ScalarType::NumOptions) &&
                    ndim >= 0 && ndim <= kMaxDims,
                "torch_mp.pipeline: malformed tensor metadata");
    layout.dtypes.push_back(static_cast<at::ScalarType>(dtype));
    layout.shapes.emplace_back(in + i, in + i + ndim);
    i += ndim;
  }
  return layout;
}

// Header of a data message.
struct Header {
  MessageStamp stamp;
  int64_t flag;
};

at::Tensor packed_buffer(int64_t bytes, MessageStamp stamp, Flag flag, at::Device device) {
  const auto options = at::TensorOptions(at::kByte).device(device);
  // A marker carries nothing after its header: zeros rather than whatever memory held.
  auto buffer = flag == kData ? at::empty({bytes}, options) : at::zeros({bytes}, options);
  const auto header = at::tensor(
      {stamp.pipeline, stamp.step, stamp.message, static_cast<int64_t>(flag)}, at::kLong);
  buffer.narrow(0, 0, header.nbytes()).copy_(header.view(at::kByte));
  return buffer;
}

Header header_of(const at::Tensor& buffer) {
  const auto header = buffer.narrow(0, 0, 4 * sizeof(int64_t)).cpu().view(at::kLong);
  const auto* in = header.data_ptr<int64_t>();
  return {stamp_in(in), in[3]};
}

// The tensors of `layout` as views of `buffer`'s bytes after the header.
std::vector<at::Tensor> views(const at::Tensor& buffer, const MessageLayout& layout) {
  std::vector<at::Tensor> tensors;
  int64_t offset = kHeaderBytes;
  for (size_t n = 0; n < layout.dtypes.size(); ++n) {
    const int64_t bytes = nbytes(layout.dtypes[n], layout.shapes[n]);
    tensors.push_back(
        buffer.narrow(0, offset, bytes).view(layout.dtypes[n]).view(layout.shapes[n]));
    offset += aligned(bytes);
  }
  return tensors;
}

c10::intrusive_ptr<c10d::Work> send_one(at::Tensor tensor,
                                        int peer,
                                        int tag,
                                        const GroupPtr& group) {
  check_device(tensor, group, "torch_mp.pipeline send");
  return comm::send(std::move(tensor), peer, tag, group);
}

at::Tensor recv_one(at::Tensor tensor, int peer, int tag, const GroupPtr& group) {
  check_device(tensor, group, "torch_mp.pipeline receive");
  std::vector<at::Tensor> one{tensor};
  group->recv(one, peer, tag)->wait();
  return tensor;
}

}  // namespace

MessageLayout MessageLayout::of(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) <= kMaxTensorsPerMessage,
              "torch_mp.pipeline: a stage passes ",
              tensors.size(),
              " tensors to the next; at most ",
              kMaxTensorsPerMessage,
              " are supported");
  MessageLayout layout;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.dim() <= kMaxDims,
                "torch_mp.pipeline: tensors passed between stages have at most ",
                kMaxDims,
                " dims, got ",
                t.dim());
    layout.dtypes.push_back(t.scalar_type());
    layout.shapes.push_back(t.sizes().vec());
  }
  return layout;
}

int64_t MessageLayout::packed_bytes() const {
  int64_t bytes = kHeaderBytes;
  for (size_t n = 0; n < dtypes.size(); ++n) {
    bytes += aligned(nbytes(dtypes[n], shapes[n]));
  }
  return bytes;
}

std::vector<c10::intrusive_ptr<c10d::Work>> send_tensors(const std::vector<at::Tensor>& tensors,
                                                         int peer,
                                                         Tags tags,
                                                         const GroupPtr& group,
                                                         MessageStamp stamp,
                                                         Channel& channel) {
  const at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
  auto layout = MessageLayout::of(tensors);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  int data_tag = tags(1);
  if (!channel.layout || !(*channel.layout == layout)) {
    if (channel.layout) {  // the receiver waits for a message of the old size: say it changed
      works.push_back(
          send_one(packed_buffer(channel.layout->packed_bytes(), stamp, kChanged, device),
                   peer,
                   tags(1),
                   group));
      data_tag = tags(2);
    }
    works.push_back(send_one(encode(layout, stamp).to(device), peer, tags(0), group));
  }
  auto buffer = packed_buffer(layout.packed_bytes(), stamp, kData, device);
  const auto targets = views(buffer, layout);
  for (size_t n = 0; n < tensors.size(); ++n) {
    targets[n].copy_(tensors[n].detach());
  }
  works.push_back(send_one(std::move(buffer), peer, data_tag, group));
  channel.layout = std::move(layout);
  return works;
}

std::vector<c10::intrusive_ptr<c10d::Work>> send_failure(const PeerFailure& failure,
                                                         int peer,
                                                         Tags tags,
                                                         const GroupPtr& group,
                                                         MessageStamp stamp,
                                                         const Channel& channel,
                                                         at::Device device) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (channel.layout) {  // the receiver waits for data of the channel's size
    works.push_back(send_one(packed_buffer(channel.layout->packed_bytes(), stamp, kFailed, device),
                             peer,
                             tags(1),
                             group));
  } else {  // for metadata
    auto marker = at::zeros({kMetadataLength}, at::kLong);
    marker[0] = stamp.pipeline;
    marker[1] = stamp.step;
    marker[2] = stamp.message;
    marker[kCount] = kFailedCount;
    works.push_back(send_one(marker.to(device), peer, tags(0), group));
  }
  auto text = at::zeros({kFailureBytes}, at::kByte);
  auto* bytes = text.data_ptr<uint8_t>();
  const int64_t header[2] = {failure.origin, failure.group_broken ? 1 : 0};
  std::memcpy(bytes, header, sizeof(header));
  const std::string message = failure.what();
  std::memcpy(bytes + sizeof(header),
              message.data(),
              std::min<size_t>(message.size(), kFailureBytes - sizeof(header) - 1));
  works.push_back(send_one(text.to(device), peer, tags(3), group));
  return works;
}

PendingRecv post_recv(
    int peer, Tags tags, const GroupPtr& group, at::Device device, const Channel& channel) {
  PendingRecv pending{peer, tags, channel.layout.has_value(), {}, {}};
  pending.buffer =
      channel.layout
          ? at::empty({channel.layout->packed_bytes()}, at::TensorOptions(at::kByte).device(device))
          : at::empty({kMetadataLength}, at::TensorOptions(at::kLong).device(device));
  check_device(pending.buffer, group, "torch_mp.pipeline receive");
  pending.work = comm::recv(pending.buffer, peer, tags(pending.expects_data ? 1 : 0), group);
  return pending;
}

std::vector<at::Tensor> finish_recv(PendingRecv& pending,
                                    const GroupPtr& group,
                                    at::Device device,
                                    MessageStamp expected,
                                    const std::string& what,
                                    Channel& channel) {
  pending.work->wait();
  int data_tag = pending.tags(1);
  at::Tensor metadata;
  if (pending.expects_data) {
    const Header header = header_of(pending.buffer);
    check_stamp(header.stamp, expected, what);
    if (header.flag == kFailed) {
      raise_peer_failure(pending.peer, pending.tags, group, device);
    }
    TORCH_CHECK(header.flag == kData || header.flag == kChanged,
                "torch_mp.pipeline: ",
                what,
                " received a malformed message (flag ",
                header.flag,
                ")");
    if (header.flag == kData) {
      return views(pending.buffer, *channel.layout);
    }
    metadata = recv_one(at::empty({kMetadataLength}, at::TensorOptions(at::kLong).device(device)),
                        pending.peer,
                        pending.tags(0),
                        group);
    data_tag = pending.tags(2);
  } else {
    metadata = pending.buffer;
  }
  const auto metadata_cpu = metadata.cpu();
  if (metadata_cpu.data_ptr<int64_t>()[kCount] == kFailedCount) {
    check_stamp(stamp_in(metadata_cpu.data_ptr<int64_t>()), expected, what);
    raise_peer_failure(pending.peer, pending.tags, group, device);
  }
  channel.layout = decode(metadata_cpu, expected, what);
  auto buffer = recv_one(
      at::empty({channel.layout->packed_bytes()}, at::TensorOptions(at::kByte).device(device)),
      pending.peer,
      data_tag,
      group);
  check_stamp(header_of(buffer).stamp, expected, what);
  return views(buffer, *channel.layout);
}

}  // namespace torch_mp::pipeline
