#pragma once
// What the pipeline schedule tests share (pipeline_schedule_test.cpp, _structure_test.cpp and
// _errors_test.cpp): the costs they replay with and the sizes they sweep.

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "torch_mp/pipeline/simulate.h"

namespace torch_mp::pipeline {
namespace {

inline constexpr double kTolerance = 1e-12;

/// The costs the 1F1B papers use: a backward twice a forward, comm free.
inline CostModel forward1_backward2() {
  CostModel costs;
  costs.forward = 1.0;
  costs.backward = 2.0;
  return costs;
}

/// F = B = W = 1 (so BW = 2), the ZB-H1 paper's setting.
inline CostModel unit_split_costs() {
  CostModel costs;
  costs.forward = 1.0;
  costs.backward = 1.0;
  costs.weight = 1.0;
  return costs;
}

// ---- Sizes the tests sweep -------------------------------------------------------------------

/// p ranks and m micro-batches for one-stage-per-rank schedules.
struct PipelineSize {
  int64_t p;
  int64_t m;
};

inline void PrintTo(const PipelineSize& s, std::ostream* os) {
  *os << "p " << s.p << ", m " << s.m;
}

inline std::string size_name(const ::testing::TestParamInfo<PipelineSize>& info) {
  return "p" + std::to_string(info.param.p) + "_m" + std::to_string(info.param.m);
}

/// p in {2, 4}, m in {p, 2p, 4p}.
inline std::vector<PipelineSize> theory_sizes() {
  std::vector<PipelineSize> sizes;
  for (int64_t p : {2, 4}) {
    for (int64_t m : {p, 2 * p, 4 * p}) {
      sizes.push_back({p, m});
    }
  }
  return sizes;
}

}  // namespace
}  // namespace torch_mp::pipeline
