#pragma once
// Crash-safe publication of a checkpoint directory: everything is written into a temporary
// directory beside its final path, flushed to disk, then renamed into place.
//
//   <path>.partial-<tag>     being written; removed by the next save if its writer died
//   <path>                   complete
//   <path>.previous-<tag>    the earlier checkpoint, set aside during the two renames and
//                            removed last: at every moment <path>, or this, is complete
//
// Tags are rank 0's clock in ns, zero-padded, so that of several set aside the newest sorts last.

#include <string>

#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// One tag for this save's temporary directory on every rank of `group` (null: this process
/// alone): rank 0's clock in ns, zero-padded to 20 digits. Collective over `group`.
std::string save_tag(const GroupPtr& group);

/// The temporary directory that a save to `path` tagged `tag` writes into.
std::string partial_path(const std::string& path, const std::string& tag);

/// Flushes the file or directory `path` to disk (nothing if it cannot be opened).
void fsync_path(const std::string& path);

/// Writes `contents` into `file` and flushes it to disk; raises "writing <file> failed".
void write_durably(const std::string& file, const std::string& contents);

/// Renames the finished `partial` to `path`, an earlier checkpoint there set aside first (as
/// "<path>.previous-<tag>") and removed last: at every moment `path` or the one set aside is
/// complete.
void move_into_place(const std::string& partial, const std::string& path, const std::string& tag);

/// Removes what saves to `path` that died left behind: unfinished directories, and earlier
/// checkpoints set aside when `path` itself is complete (holds `last_written`, the file a save
/// writes last).
void remove_leftovers(const std::string& path, const std::string& last_written);

/// `path`, or the earlier checkpoint set aside while a newer one was moved into place (a save
/// killed between its two renames). Raises "no checkpoint at <path>" if there is neither.
std::string checkpoint_directory(const std::string& path);

}  // namespace torch_mp::checkpoint
