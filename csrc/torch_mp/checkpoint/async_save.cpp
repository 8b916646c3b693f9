// Saves in the background (async_save.h).

#include "torch_mp/checkpoint/async_save.h"

#include <ATen/ATen.h>

#include <iostream>
#include <utility>

#include "torch_mp/agreement.h"
#include "torch_mp/checkpoint/shard_writer.h"

namespace torch_mp::checkpoint {
namespace {

// The last save started by this thread (a rank's; ranks that are threads of one process,
// as in tests, each have their own).
thread_local std::shared_ptr<AsyncSave> pending_save;

}  // namespace

AsyncSave::AsyncSave(std::string path, std::function<void()> write) : path_(std::move(path)) {
  thread_ = std::thread([this, write = std::move(write)] {
    std::exception_ptr error;
    try {
      write();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    finished_ = true;
  });
}

AsyncSave::~AsyncSave() {
  join();
  if (error_ && !reported_) {  // a failure nobody waited for must not vanish
    try {
      std::rethrow_exception(error_);
    } catch (const c10::Error& e) {
      std::cerr << "torch_mp: a background checkpoint save nobody waited for failed: "
                << e.what_without_backtrace() << std::endl;
    } catch (const std::exception& e) {
      std::cerr << "torch_mp: a background checkpoint save nobody waited for failed: " << e.what()
                << std::endl;
    }
  }
}

void AsyncSave::wait() {
  join();
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) {
    reported_ = true;
    std::rethrow_exception(error_);
  }
}

bool AsyncSave::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

void AsyncSave::join() {
  std::lock_guard<std::mutex> lock(join_mutex_);
  if (thread_.joinable()) {
    thread_.join();
  }
}

at::Tensor snapshot(const at::Tensor& tensor) {
  const auto source = tensor.detach();
  if (source.is_cpu()) {
    return source.clone(at::MemoryFormat::Contiguous);
  }
  auto copy =
      at::empty(source.sizes(), source.options().device(at::kCPU).pinned_memory(source.is_cuda()));
  copy.copy_(source);
  return copy;
}

std::shared_ptr<AsyncSave> async_save(const std::string& path,
                                      const SaveRequest& request,
                                      const GroupPtr& group) {
  wait_for_pending_save();
  // The snapshot is agreed on: a rank that failed to take it alone would leave the others'
  // background saves to pair up with its next one.
  SaveRequest copy = request;
  copy.shards.clear();
  std::vector<std::string> problems;
  collect_problems(problems, [&] {
    for (const auto& shard : request.shards) {
      if (request.file && writes(shard)) {
        copy.shards.push_back(shard);
        copy.shards.back().tensor = snapshot(shard.tensor);
      }
    }
  });
  raise_anywhere(problems, "torch_mp::checkpoint::async_save of " + path + " failed", group);
  auto handle = std::make_shared<AsyncSave>(
      path, [path, copy = std::move(copy), group] { write_checkpoint(path, copy, group); });
  pending_save = handle;
  return handle;
}

void wait_for_pending_save() {
  const auto save = std::move(pending_save);
  pending_save = nullptr;
  if (!save) {
    return;
  }
  save->join();
  std::lock_guard<std::mutex> lock(save->mutex_);
  if (save->error_ && !save->reported_) {
    save->reported_ = true;
    std::rethrow_exception(save->error_);
  }
}

}  // namespace torch_mp::checkpoint
