#pragma once
// Problems one rank finds, raised on every rank: a rank that raised alone would leave the others
// waiting in their next collective. Each rank collects what went wrong on it; one exchange then
// tells every rank whether any rank has problems, and which rank's to report.

#include <c10/util/Exception.h>

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "torch_mp/process_groups.h"

namespace torch_mp::checkpoint {

/// Runs `body`, turning an exception into one of `problems` (which raise_anywhere then reports
/// on every rank: a rank that raised alone would leave the others waiting).
template <typename Body>
void collect_problems(std::vector<std::string>& problems, const Body& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    problems.push_back(e.what_without_backtrace());
  } catch (const std::exception& e) {
    problems.push_back(e.what());
  }
}

/// Raises on every rank of `group` (this rank only when `group` is null) if any rank has
/// `problems`: "<what> on rank <r>: <its problems>", this rank's own if it has any.
void raise_anywhere(const std::vector<std::string>& problems,
                    const std::string& what,
                    const GroupPtr& group);

/// What raise_anywhere raises, without raising it: the text of the first rank of `group` with
/// problems (this rank's own if it has some), or nullopt when no rank has any. Collective over
/// `group` (may be null).
std::optional<std::string> failure_anywhere(const std::vector<std::string>& problems,
                                            const std::string& what,
                                            const GroupPtr& group);

/// Up to eight of `items` joined by "; ", and how many more there are.
std::string summary_of(const std::vector<std::string>& items);

}  // namespace torch_mp::checkpoint
