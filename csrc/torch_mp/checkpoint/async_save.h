#pragma once
// A save that lets training go on: what it will write is copied first (a snapshot), then a
// background thread writes the copy exactly as save (shard_writer.h) does, crash-safe
// publication included, while the caller changes its parameters and optimizer state.
//
//   auto handle = async_save(path, shards, file, files, metadata, root_files, group);
//   ... training steps ...
//   handle->wait();  // raises, on every rank alike, what the save raised
//
// One save at a time per rank (the thread that calls them): async_save and save first wait for
// a background save still running (and raise its failure if nobody has heard of it yet).

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "torch_mp/checkpoint/shard_geometry.h"
#include "torch_mp/checkpoint/shard_writer.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// A save running in the background, from async_save.
class AsyncSave {
 public:
  /// Starts `write` in a background thread; `path` names the checkpoint in messages.
  AsyncSave(std::string path, std::function<void()> write);
  /// Waits for the write (a handle dropped unwaited is still waited for by the next save).
  ~AsyncSave();
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  /// Blocks until the save has finished. Raises what it raised (the same on every rank, as
  /// save's failures are), each time it is called.
  void wait();
  /// Whether the save has finished (then wait() returns or raises at once).
  bool done() const;
  /// The checkpoint directory being written.
  const std::string& path() const { return path_; }

 private:
  friend void wait_for_pending_save();
  void join();

  std::string path_;
  std::mutex join_mutex_;
  mutable std::mutex mutex_;
  bool finished_ = false;
  bool reported_ = false;  // wait() has raised the failure to its caller
  std::exception_ptr error_;
  std::thread thread_;
};

/// A copy of `tensor` that later changes to it do not reach: in pinned CPU memory for a CUDA
/// tensor (so the copy does not wait on pageable memory), a clone on a CPU.
at::Tensor snapshot(const at::Tensor& tensor);

/// save (shard_writer.h) of the same arguments, in the background: the blocks this rank
/// writes are snapshot before it returns, so the caller may change the shards' tensors at once.
/// `group` must be a group of its own, used by nothing else until the save is done (another
/// thread's collectives on it would interleave with the save's). Collective over `group`.
std::shared_ptr<AsyncSave> async_save(const std::string& path,
                                      const SaveRequest& request,
                                      const GroupPtr& group);

/// Waits for the background save that this thread started and that may still be running; raises its
/// failure unless its handle's wait() has raised it already. save and async_save call it first.
void wait_for_pending_save();

}  // namespace torch_mp::checkpoint
