#include "torch_mp/plan/probe.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "torch_mp/comm.h"

namespace torch_mp::plan {

double time_all_reduce(const GroupPtr& group, int64_t elements, int64_t repeats) {
  TORCH_CHECK(group && repeats > 0, "time_all_reduce: needs a group and a repeat");
  std::vector<at::Tensor> tensors{
      at::ones({elements}, at::TensorOptions().device(device_of(group)))};
  const auto run = [&] {
    const auto start = std::chrono::steady_clock::now();
    comm::wait(group->allreduce(tensors), group, "all_reduce");
    (void)tensors[0][0].item<float>();  // (on a device: until it has run)
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  run();
  std::vector<double> seconds;
  for (int64_t i = 0; i < repeats; ++i) {
    seconds.push_back(run());
  }
  std::nth_element(seconds.begin(), seconds.begin() + repeats / 2, seconds.end());
  return seconds[repeats / 2];
}

}  // namespace torch_mp::plan
