#pragma once
// Cutting a sequence of layers into balanced pipeline stages.

#include <cstdint>
#include <vector>

namespace torch_mp::pipeline {

/// Splits layers with the given `costs` (parameter counts, measured times, ...) into
/// `num_stages` contiguous, non-empty stages so that the costliest stage is as cheap as
/// possible. Returns the number of layers in each stage. Among equally good cuts the one with
/// the latest boundaries is taken, so earlier stages get the extra layers.
///
/// Raises if `num_stages` is not positive, exceeds the number of layers, or a cost is negative.
std::vector<int64_t> balanced_partition(const std::vector<double>& costs, int64_t num_stages);

}  // namespace torch_mp::pipeline
