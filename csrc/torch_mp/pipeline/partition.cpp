#include "torch_mp/pipeline/partition.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

namespace torch_mp::pipeline {

std::vector<int64_t> balanced_partition(const std::vector<double>& costs, int64_t num_stages) {
  const auto n = static_cast<int64_t>(costs.size());
  TORCH_CHECK(
      num_stages > 0, "torch_mp.pipeline.partition: num_stages must be positive, got ", num_stages);
  TORCH_CHECK(num_stages <= n,
              "torch_mp.pipeline.partition: cannot cut ",
              n,
              " layers into ",
              num_stages,
              " non-empty stages");
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(costs[i] >= 0,
                "torch_mp.pipeline.partition: layer ",
                i,
                " has a negative cost (",
                costs[i],
                ")");
    prefix[i + 1] = prefix[i] + costs[i];
  }
  // best[k][i]: the smallest possible costliest stage when the first i layers form k stages;
  // cut[k][i]: where the last of those k stages starts.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int64_t>> cut(num_stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0.0;
  for (int64_t k = 1; k <= num_stages; ++k) {
    for (int64_t i = k; i <= n - (num_stages - k); ++i) {
      for (int64_t start = k - 1; start < i; ++start) {
        const double worst = std::max(best[k - 1][start], prefix[i] - prefix[start]);
        if (worst <= best[k][i]) {  // `<=`: prefer the latest start among ties
          best[k][i] = worst;
          cut[k][i] = start;
        }
      }
    }
  }
  std::vector<int64_t> sizes(num_stages);
  for (int64_t k = num_stages, end = n; k > 0; --k) {
    const int64_t start = cut[k][end];
    sizes[k - 1] = end - start;
    end = start;
  }
  return sizes;
}

}  // namespace torch_mp::pipeline
