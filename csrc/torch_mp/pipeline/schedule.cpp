#include "torch_mp/pipeline/schedule.h"

#include <c10/util/Exception.h>

#include <regex>
#include <sstream>

#include "torch_mp/errors.h"
#include "torch_mp/pipeline/zero_bubble.h"

namespace torch_mp::pipeline {

namespace {

// The schedules make_schedule knows, and the stages each rank runs under them by default.
struct KnownSchedule {
  const char* name;
  int64_t stages_per_rank;
};
constexpr KnownSchedule kSchedules[] = {
    {"gpipe", 1},
    {"1f1b", 1},
    {"interleaved_1f1b", 2},
    {"zb_h1", 1},
    {"interleaved_zb", 2},
    {"zbv", 2},
};

constexpr ActionKind kAllKinds[] = {
    ActionKind::kForward,
    ActionKind::kBackwardInput,
    ActionKind::kBackwardWeight,
    ActionKind::kFullBackward,
    ActionKind::kSendForward,
    ActionKind::kRecvForward,
    ActionKind::kSendBackward,
    ActionKind::kRecvBackward,
};

using RankActions = std::vector<std::vector<Action>>;

// GPipe: every forward, then every backward.
RankActions gpipe(int64_t ranks, int64_t m) {
  RankActions out(ranks);
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < m; ++i) {
      out[r].push_back({ActionKind::kForward, r, i});
    }
    for (int64_t i = 0; i < m; ++i) {
      out[r].push_back({ActionKind::kFullBackward, r, i});
    }
  }
  return out;
}

// Interleaved 1F1B over `chunks` stages per rank (plain 1F1B when chunks == 1). Rank r runs a
// warm-up of forwards, then alternates one forward with one backward, then drains backwards:
//
//   rank 0 of 2, m = 4:  F0 | F1 B0 F2 B1 F3 B2 | B3      (warm-up p - r - 1 = 1 for 1F1B)
//
// With chunks v > 1, the k-th forward of a rank is micro-batch (k / (p v)) p + k % p on its
// chunk (k % (p v)) / p, i.e. groups of p micro-batches visit the rank's chunks in turn;
// backwards visit the chunks in reverse. Warm-up: 2 (p - r - 1) + (v - 1) p forwards.
RankActions one_f_one_b(int64_t ranks, int64_t m, int64_t chunks, ActionKind backward) {
  RankActions out(ranks);
  const int64_t total = m * chunks;
  const int64_t group = ranks * chunks;
  auto forward_at = [&](int64_t r, int64_t k) {
    const int64_t chunk = (k % group) / ranks;
    return Action{ActionKind::kForward, chunk * ranks + r, (k / group) * ranks + k % ranks};
  };
  auto backward_at = [&](int64_t r, int64_t k) {
    const int64_t chunk = chunks - 1 - (k % group) / ranks;
    return Action{backward, chunk * ranks + r, (k / group) * ranks + k % ranks};
  };
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t warmup = chunks == 1
                               ? std::min(ranks - r - 1, total)
                               : std::min(2 * (ranks - r - 1) + (chunks - 1) * ranks, total);
    for (int64_t k = 0; k < warmup; ++k) {
      out[r].push_back(forward_at(r, k));
    }
    for (int64_t k = 0; k + warmup < total; ++k) {
      out[r].push_back(forward_at(r, k + warmup));
      out[r].push_back(backward_at(r, k));
    }
    for (int64_t k = std::max<int64_t>(total - warmup, 0); k < total; ++k) {
      out[r].push_back(backward_at(r, k));
    }
  }
  return out;
}

void check_sizes(const std::string& name, int64_t stages, int64_t m, int64_t per_rank) {
  TORCH_MP_CHECK_LAYOUT(stages > 0 && m > 0 && per_rank > 0,
                        "torch_mp.pipeline.schedule: num_stages (",
                        stages,
                        "), num_microbatches (",
                        m,
                        ") and stages_per_rank (",
                        per_rank,
                        ") must be positive");
  TORCH_MP_CHECK_LAYOUT(stages % per_rank == 0,
                        "torch_mp.pipeline.schedule: num_stages (",
                        stages,
                        ") must be divisible by stages_per_rank (",
                        per_rank,
                        ")");
  const int64_t ranks = stages / per_rank;
  if (name == "interleaved_1f1b" || name == "interleaved_zb") {
    TORCH_MP_CHECK_LAYOUT(per_rank >= 2,
                          "torch_mp.pipeline.schedule: ",
                          name,
                          " needs stages_per_rank >= 2 (got ",
                          per_rank,
                          "); use ",
                          name == "interleaved_zb" ? "zb_h1" : "1f1b",
                          " for one stage per rank");
    TORCH_MP_CHECK_LAYOUT(m % ranks == 0,
                          "torch_mp.pipeline.schedule: ",
                          name,
                          " needs num_microbatches (",
                          m,
                          ") divisible by the number of pipeline ranks (",
                          ranks,
                          ")");
  } else if (name == "zbv") {
    TORCH_MP_CHECK_LAYOUT(
        per_rank == 2,
        "torch_mp.pipeline.schedule: zbv runs two stages per rank (stages_per_rank=2), "
        "placed in a V, got ",
        per_rank);
  } else {
    TORCH_MP_CHECK_LAYOUT(per_rank == 1,
                          "torch_mp.pipeline.schedule: ",
                          name,
                          " runs one stage per rank (stages_per_rank=1), got ",
                          per_rank);
  }
}

}  // namespace

const char* kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackwardInput:
      return "B";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kFullBackward:
      return "BW";
    case ActionKind::kSendForward:
      return "SEND_F";
    case ActionKind::kRecvForward:
      return "RECV_F";
    case ActionKind::kSendBackward:
      return "SEND_B";
    case ActionKind::kRecvBackward:
      return "RECV_B";
  }
  return "?";
}

const char* placement_name(Placement placement) {
  return placement == Placement::kV ? "v" : "loop";
}

int64_t rank_of_stage(int64_t stage, int64_t num_ranks, Placement placement) {
  const int64_t chunk = stage / num_ranks;
  const int64_t index = stage % num_ranks;
  return placement == Placement::kV && chunk % 2 == 1 ? num_ranks - 1 - index : index;
}

int64_t Schedule::rank_of_stage(int64_t stage) const {
  return pipeline::rank_of_stage(stage, num_ranks(), placement);
}

std::vector<int64_t> Schedule::stages_of_rank(int64_t rank) const {
  std::vector<int64_t> stages;
  for (int64_t chunk = 0; chunk < stages_per_rank; ++chunk) {
    const bool reversed = placement == Placement::kV && chunk % 2 == 1;
    stages.push_back(chunk * num_ranks() + (reversed ? num_ranks() - 1 - rank : rank));
  }
  return stages;
}

bool is_compute(ActionKind kind) {
  return kind == ActionKind::kForward || kind == ActionKind::kBackwardInput ||
         kind == ActionKind::kBackwardWeight || kind == ActionKind::kFullBackward;
}

std::string Action::to_string() const {
  std::ostringstream out;
  out << kind_name(kind) << "(" << stage << "," << microbatch << ")";
  return out.str();
}

Action Action::parse(const std::string& text) {
  static const std::regex pattern(R"(\s*([A-Z_]+)\(\s*(\d{1,9})\s*,\s*(\d{1,9})\s*\)\s*)");
  std::smatch match;
  TORCH_CHECK(std::regex_match(text, match, pattern),
              "torch_mp.pipeline: cannot read action '",
              text,
              "' (expected e.g. F(0,3), BW(1,0), SEND_F(0,2))");
  for (ActionKind kind : kAllKinds) {
    if (match[1] == kind_name(kind)) {
      return Action{kind, std::stoll(match[2]), std::stoll(match[3])};
    }
  }
  TORCH_CHECK(false,
              "torch_mp.pipeline: unknown action kind '",
              match[1].str(),
              "' in '",
              text,
              "' (known: F B W BW SEND_F RECV_F SEND_B RECV_B)");
}

std::string Schedule::to_string() const {
  std::ostringstream out;
  out << "# torch_mp schedule " << name << ": num_stages=" << num_stages
      << " num_microbatches=" << num_microbatches << " stages_per_rank=" << stages_per_rank;
  if (placement != Placement::kLoop) {
    out << " placement=" << placement_name(placement);
  }
  out << "\n";
  for (int64_t r = 0; r < num_ranks(); ++r) {
    out << "rank " << r << ":";
    for (const Action& action : actions[r]) {
      out << " " << action.to_string();
    }
    out << "\n";
  }
  return out.str();
}

Schedule Schedule::parse(const std::string& text) {
  static const std::regex header(
      R"(#\s*torch_mp schedule\s+(\S+):\s*num_stages=(\d+)\s+num_microbatches=(\d+)\s+stages_per_rank=(\d+)(?:\s+placement=(loop|v))?\s*)");
  static const std::regex rank_line(R"(\s*rank\s+(\d+)\s*:(.*))");
  Schedule schedule;
  bool have_header = false;
  std::istringstream lines(text);
  std::string line;
  for (int line_number = 1; std::getline(lines, line); ++line_number) {
    std::smatch match;
    if (std::regex_match(line, match, header)) {
      schedule.name = match[1];
      schedule.num_stages = std::stoll(match[2]);
      schedule.num_microbatches = std::stoll(match[3]);
      schedule.stages_per_rank = std::stoll(match[4]);
      schedule.placement = match[5] == "v" ? Placement::kV : Placement::kLoop;
      have_header = true;
    } else if (std::regex_match(line, match, rank_line)) {
      const auto rank = std::stoll(match[1]);
      TORCH_CHECK(rank == schedule.num_ranks(),
                  "torch_mp.pipeline: line ",
                  line_number,
                  ": expected rank ",
                  schedule.num_ranks(),
                  ", found rank ",
                  rank);
      std::vector<Action> actions;
      std::istringstream tokens(match[2].str());
      for (std::string token; tokens >> token;) {
        try {
          actions.push_back(Action::parse(token));
        } catch (const c10::Error& e) {
          TORCH_CHECK(
              false, "torch_mp.pipeline: line ", line_number, ": ", e.what_without_backtrace());
        }
      }
      schedule.actions.push_back(std::move(actions));
    } else {
      const auto first = line.find_first_not_of(" \t\r");
      TORCH_CHECK(first == std::string::npos || line[first] == '#',
                  "torch_mp.pipeline: line ",
                  line_number,
                  " is neither 'rank R: ACTIONS' nor a comment: '",
                  line,
                  "'");
    }
  }
  TORCH_CHECK(schedule.num_ranks() > 0, "torch_mp.pipeline: the schedule text has no rank lines");
  if (have_header) {
    TORCH_CHECK(schedule.stages_per_rank > 0 &&
                    schedule.num_stages == schedule.num_ranks() * schedule.stages_per_rank,
                "torch_mp.pipeline: the header's num_stages (",
                schedule.num_stages,
                ") and stages_per_rank (",
                schedule.stages_per_rank,
                ") do not match the ",
                schedule.num_ranks(),
                " rank lines");
  } else {
    schedule.name = "custom";
    schedule.stages_per_rank = 1;
    for (const auto& actions : schedule.actions) {
      for (const Action& action : actions) {
        schedule.num_stages = std::max(schedule.num_stages, action.stage + 1);
        schedule.num_microbatches = std::max(schedule.num_microbatches, action.microbatch + 1);
      }
    }
    schedule.stages_per_rank = std::max<int64_t>(1, schedule.num_stages / schedule.num_ranks());
  }
  return schedule;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const auto& known : kSchedules) {
    names.emplace_back(known.name);
  }
  return names;
}

int64_t default_stages_per_rank(const std::string& name) {
  for (const auto& known : kSchedules) {
    if (name == known.name) {
      return known.stages_per_rank;
    }
  }
  std::string names;
  for (const auto& known : kSchedules) {
    names += std::string(names.empty() ? "" : ", ") + known.name;
  }
  TORCH_MP_CHECK_LAYOUT(
      false, "torch_mp.pipeline.schedule: unknown schedule '", name, "' (known: ", names, ")");
  return 0;
}

std::vector<std::vector<Action>> with_communication(const std::vector<std::vector<Action>>& compute,
                                                    int64_t num_stages,
                                                    Placement placement) {
  const auto ranks = static_cast<int64_t>(compute.size());
  auto remote = [&](int64_t stage, int64_t neighbour) {
    return neighbour >= 0 && neighbour < num_stages &&
           rank_of_stage(neighbour, ranks, placement) != rank_of_stage(stage, ranks, placement);
  };
  std::vector<std::vector<Action>> out(ranks);
  for (int64_t r = 0; r < ranks; ++r) {
    for (const Action& a : compute[r]) {
      const bool forward = a.kind == ActionKind::kForward;
      const bool backward =
          a.kind == ActionKind::kFullBackward || a.kind == ActionKind::kBackwardInput;
      if (forward && remote(a.stage, a.stage - 1)) {
        out[r].push_back({ActionKind::kRecvForward, a.stage, a.microbatch});
      }
      if (backward && remote(a.stage, a.stage + 1)) {
        out[r].push_back({ActionKind::kRecvBackward, a.stage, a.microbatch});
      }
      out[r].push_back(a);
      if (forward && remote(a.stage, a.stage + 1)) {
        out[r].push_back({ActionKind::kSendForward, a.stage, a.microbatch});
      }
      if (backward && remote(a.stage, a.stage - 1)) {
        out[r].push_back({ActionKind::kSendBackward, a.stage, a.microbatch});
      }
    }
  }
  return out;
}

Schedule make_schedule(const std::string& name,
                       int64_t num_stages,
                       int64_t num_microbatches,
                       int64_t stages_per_rank) {
  default_stages_per_rank(name);  // (raises on an unknown name)
  check_sizes(name, num_stages, num_microbatches, stages_per_rank);
  const int64_t ranks = num_stages / stages_per_rank;
  const Placement placement = name == "zbv" ? Placement::kV : Placement::kLoop;
  RankActions compute;
  if (name == "gpipe") {
    compute = gpipe(ranks, num_microbatches);
  } else if (name == "1f1b" || name == "interleaved_1f1b") {
    compute = one_f_one_b(ranks, num_microbatches, stages_per_rank, ActionKind::kFullBackward);
  } else if (name == "zb_h1" || name == "interleaved_zb") {
    compute = zero_bubble_fill(
        one_f_one_b(ranks, num_microbatches, stages_per_rank, ActionKind::kBackwardInput),
        num_stages,
        num_microbatches);
  } else {
    compute = zero_bubble_v(ranks, num_microbatches);
  }
  return Schedule{name,
                  num_stages,
                  num_microbatches,
                  stages_per_rank,
                  placement,
                  with_communication(compute, num_stages, placement)};
}

}  // namespace torch_mp::pipeline
