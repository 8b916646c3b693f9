#include "torch_mp/agreement.h"

#include <ATen/ATen.h>

#include <atomic>
#include <bit>
#include <cstdlib>
#include <functional>
#include <sstream>

#include "torch_mp/comm.h"

namespace torch_mp {
namespace {

std::atomic<bool> collective_checks{[] {
  const char* value = std::getenv("TORCH_MP_CHECK_COLLECTIVES");
  return value != nullptr && std::string(value) == "1";
}()};
// The checks' own all-gathers are not checked again.
thread_local bool inside_check = false;

// Runs `check` with the collective checks of its own all-gathers off.
template <typename Check>
void unchecked(Check&& check) {
  inside_check = true;
  try {
    check();
  } catch (...) {
    inside_check = false;
    throw;
  }
  inside_check = false;
}

std::string describe(const at::Tensor& x) {
  std::ostringstream out;
  out << x.scalar_type() << x.sizes();
  return out.str();
}

// Fake and functional tensors (what torch.compile traces with) hold no values to compare.
bool holds_values(const at::Tensor& x) {
  return !x.is_meta() && !x.key_set().has_any(c10::DispatchKeySet(
                             {c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// Every rank's row of `mine` (on the host), or an undefined tensor when all ranks hold the same
// row. Exchanged on the group's device: an NCCL group may have no Gloo side for CPU tensors.
at::Tensor rows_if_they_differ(const at::Tensor& mine, const GroupPtr& group) {
  const auto all = comm::all_gather(mine.unsqueeze(0).to(device_of(group)), 0, group).cpu();
  return all.eq(mine).all().item<bool>() ? at::Tensor() : all;
}

std::string disagreement(const std::string& what, const GroupPtr& group) {
  std::ostringstream msg;
  msg << "torch_mp: " << what << " must be the same on every rank of the group, but ranks "
      << "disagree (seen on rank " << group->getRank() << "):";
  return msg.str();
}

// ---- problems raised on every rank ----

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
  const auto all = comm::all_gather_text(mine, group);
  if (!problems.empty()) {
    return failure_text(what, group->getRank(), mine);
  }
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      return failure_text(what, static_cast<int64_t>(r), all[r]);
    }
  }
  return std::nullopt;
}

}  // namespace

std::string text_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

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
  std::string mine = summary_of(problems);
  if (!problems.empty() && mine.empty()) {  // (problems given as empty texts)
    mine = kNoMessage;
  }
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

void set_check_collectives(bool on) { collective_checks = on; }

bool check_collectives() { return collective_checks; }

namespace comm {

int64_t bits(double value) { return std::bit_cast<int64_t>(value); }

void check_same_across_ranks(const std::vector<int64_t>& values,
                             const GroupPtr& group,
                             const std::string& what) {
  TORCH_CHECK(group, "torch_mp: a check across ranks was given no process group");
  if (group->getSize() == 1) {
    return;
  }
  const auto all = rows_if_they_differ(at::tensor(values, at::kLong), group);
  if (!all.defined()) {
    return;
  }
  std::ostringstream msg;
  msg << disagreement(what, group);
  for (int64_t r = 0; r < all.size(0); ++r) {
    msg << " rank " << r << " has [";
    for (int64_t i = 0; i < all.size(1); ++i) {
      msg << (i ? ", " : "") << all[r][i].item<int64_t>();
    }
    msg << "]" << (r + 1 < all.size(0) ? ";" : "");
  }
  TORCH_CHECK(false, msg.str());
}

void check_same_values_across_ranks(const std::vector<NamedValue>& values,
                                    const GroupPtr& group,
                                    const std::string& what) {
  TORCH_CHECK(group, "torch_mp: a check across ranks was given no process group");
  if (group->getSize() == 1) {
    return;
  }
  std::vector<int64_t> compared;
  for (const auto& v : values) {
    compared.push_back(v.compared);
  }
  const auto all = rows_if_they_differ(at::tensor(compared, at::kLong), group);
  if (!all.defined()) {
    return;
  }
  std::ostringstream msg;
  msg << disagreement(what, group);
  const char* separator = " ";
  for (size_t i = 0; i < values.size(); ++i) {
    const auto column = all.select(1, static_cast<int64_t>(i));
    if (column.eq(column[0]).all().item<bool>()) {
      continue;
    }
    msg << separator << values[i].name << " (here " << values[i].shown;
    if (values[i].numeric) {
      msg << "; by rank [";
      for (int64_t r = 0; r < column.size(0); ++r) {
        msg << (r ? ", " : "") << column[r].item<int64_t>();
      }
      msg << "]";
    }
    msg << ")";
    separator = ", ";
  }
  TORCH_CHECK(false, msg.str());
}

void check_same_text_across_ranks(const std::string& text,
                                  const GroupPtr& group,
                                  const std::string& what) {
  TORCH_CHECK(group, "torch_mp: a check across ranks was given no process group");
  if (group->getSize() == 1) {
    return;
  }
  constexpr int64_t kQuoted = 200;
  auto mine = at::zeros({kQuoted + 1}, at::kLong);
  auto* out = mine.data_ptr<int64_t>();
  out[0] = static_cast<int64_t>(std::hash<std::string>{}(text) >> 1);
  for (int64_t i = 0; i < kQuoted && i < static_cast<int64_t>(text.size()); ++i) {
    out[i + 1] = static_cast<unsigned char>(text[i]);
  }
  const auto all = rows_if_they_differ(mine, group);
  if (!all.defined()) {
    return;
  }
  std::ostringstream msg;
  msg << disagreement(what, group);
  for (int64_t r = 0; r < all.size(0); ++r) {
    std::string quoted;
    for (int64_t i = 1; i <= kQuoted && all[r][i].item<int64_t>() != 0; ++i) {
      quoted.push_back(static_cast<char>(all[r][i].item<int64_t>()));
    }
    msg << "\n  rank " << r << ": " << quoted;
  }
  TORCH_CHECK(false, msg.str());
}

void check_replicated(const at::Tensor& x, const GroupPtr& group, const std::string& what) {
  if (!collective_checks || inside_check || !group || group->getSize() == 1 || !holds_values(x)) {
    return;
  }
  // Replicated tensors are computed alike on every rank: compare their bytes (two checksums).
  const auto bytes = x.detach().contiguous().cpu().view({-1}).view(at::kByte).to(at::kLong);
  const auto position = at::arange(bytes.numel(), at::kLong).remainder(251).add_(1);
  std::ostringstream text;
  text << describe(x) << " values " << bytes.sum().item<int64_t>() << "/"
       << bytes.mul(position).sum().item<int64_t>();
  unchecked([&] { check_same_text_across_ranks(text.str(), group, what); });
}

void check_same_tensors_across_ranks(const std::vector<at::Tensor>& tensors,
                                     const GroupPtr& group,
                                     const std::string& what) {
  std::ostringstream shapes;
  for (const auto& t : tensors) {
    shapes << t.scalar_type() << t.sizes() << ";";
  }
  check_same_across_ranks({static_cast<int64_t>(tensors.size()),
                           static_cast<int64_t>(std::hash<std::string>{}(shapes.str()) >> 1)},
                          group,
                          what + " [count, digest of dtypes and shapes]");
}

void check_device(const at::Tensor& x, const GroupPtr& group, const char* op) {
  // (A tensor torch.compile traces with stands for one on its device: that is checked.)
  if (!collective_checks || (!x.is_meta() && !holds_values(x))) {
    return;
  }
  const at::Device expected = device_of(group);
  TORCH_CHECK(x.device().type() == expected.type(),
              "torch_mp: ",
              op,
              " on rank ",
              group->getRank(),
              " was given a tensor on ",
              x.device(),
              ", but its group (",
              group->getBackendName(),
              ") carries ",
              c10::DeviceTypeName(expected.type(), /*lower_case=*/true),
              " tensors");
}

void check_operands(const at::Tensor& x, const GroupPtr& group, const char* op) {
  check_device(x, group, op);
  if (!collective_checks || inside_check || group->getSize() == 1) {
    return;
  }
  unchecked([&] {
    check_same_text_across_ranks(
        describe(x), group, std::string("torch_mp collective ") + op + ": the tensors");
  });
}

}  // namespace comm
}  // namespace torch_mp
