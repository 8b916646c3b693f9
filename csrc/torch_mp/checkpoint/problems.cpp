// One rank's problems, raised on every rank (problems.h).

#include "torch_mp/checkpoint/problems.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "torch_mp/comm.h"

namespace torch_mp::checkpoint {
namespace {

constexpr size_t kProblemsShown = 8;

// "<what> on rank <rank>: <problems>".
std::string failure_text(const std::string& what, int64_t rank, const std::string& problems) {
  return what + " on rank " + std::to_string(rank) + ": " + problems;
}

// The problems of the first rank of `group` that has any (this rank's own, `problems` summed up
// in `mine`, if it has some): every rank takes part in the same collectives, whether or not it
// has problems.
std::optional<std::string> first_rank_problems(const std::vector<std::string>& problems,
                                               const std::string& mine,
                                               const std::string& what,
                                               const GroupPtr& group) {
  const auto longest =
      comm::all_reduce(
          at::full({1}, static_cast<int64_t>(mine.size()), at::kLong), group, c10d::ReduceOp::MAX)
          .item<int64_t>();
  if (longest == 0) {
    return std::nullopt;
  }
  auto text = at::zeros({longest + 1}, at::kByte);
  std::copy(mine.begin(), mine.end(), text.data_ptr<uint8_t>());
  const auto all = comm::all_gather(text, 0, group).view({-1, longest + 1});
  if (!problems.empty()) {
    return failure_text(what, group->getRank(), mine);
  }
  for (int64_t r = 0; r < all.size(0); ++r) {
    const auto* bytes = all[r].data_ptr<uint8_t>();
    if (bytes[0] != 0) {
      return failure_text(what, r, std::string(reinterpret_cast<const char*>(bytes)));
    }
  }
  return std::nullopt;
}

}  // namespace

std::string summary_of(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < kProblemsShown; ++i) {
    if (i) {
      out += "; ";
    }
    out += items[i];
  }
  if (items.size() > kProblemsShown) {
    out += "; and " + std::to_string(items.size() - kProblemsShown) + " more";
  }
  return out;
}

std::optional<std::string> failure_anywhere(const std::vector<std::string>& problems,
                                            const std::string& what,
                                            const GroupPtr& group) {
  const std::string mine = summary_of(problems);
  if (group && group->getSize() > 1) {
    return first_rank_problems(problems, mine, what, group);
  }
  if (!problems.empty()) {
    return failure_text(what, group ? group->getRank() : 0, mine);
  }
  return std::nullopt;
}

void raise_anywhere(const std::vector<std::string>& problems,
                    const std::string& what,
                    const GroupPtr& group) {
  if (const auto failure = failure_anywhere(problems, what, group)) {
    TORCH_CHECK(false, *failure);
  }
}

}  // namespace torch_mp::checkpoint
