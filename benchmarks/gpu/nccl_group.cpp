// The C++ NCCL group of benchmarks/gpu/check.sh, from a small LibTorch program: one rank's NCCL
// group made by torch_mp (new_process_group), an all-reduce and a pipeline step over it on the
// current CUDA device, each checked against what one process computes. Prints OK or FAILED per
// check; the exit status is 1 if any failed, 0 with a line saying why where there is no NCCL or
// no device.
//
//   build-gpu/benchmarks/gpu/nccl_group      (built with -DTORCH_MP_BUILD_GPU_CHECK=ON)

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "torch_mp/comm.h"
#include "torch_mp/pipeline/pipeline.h"
#include "torch_mp/process_groups.h"

namespace {

bool report(const char* name, double difference, double tolerance) {
  const bool ok = difference <= tolerance;
  std::printf("%s: C++ %s over NCCL: max |diff| %.2e (<= %.0e)\n",
              ok ? "OK" : "FAILED",
              name,
              difference,
              tolerance);
  return ok;
}

double worst(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs().max().item<double>();
}

}  // namespace

int main() {
  using namespace torch_mp;
  if (!nccl_available() || !torch::cuda::is_available()) {
    std::printf("skipped: C++ NCCL group (%s)\n",
                nccl_available() ? "no CUDA device" : "this build has no NCCL");
    return 0;
  }
  const auto group = new_process_group(c10::make_intrusive<c10d::HashStore>(),
                                       0,
                                       1,
                                       Backend::kNccl,
                                       std::chrono::seconds(60),
                                       "gpu_check");
  const auto device = device_of(group);
  bool ok = true;

  const auto x = torch::arange(16, torch::TensorOptions(torch::kFloat).device(device));
  ok &= report("all_reduce", worst(comm::all_reduce(x, group), x), 0.0);

  torch::manual_seed(0);
  torch::nn::Sequential stages(
      torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32));
  stages->to(device);
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(stages->clone());
  const auto input = torch::randn({8, 32}, x.options());
  const auto target = torch::randn({8, 32}, x.options());
  torch::mse_loss(reference->forward(input), target).backward();
  pipeline::Pipeline pipe(
      {pipeline::stage_of(stages)},
      [](const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& t) {
        return torch::mse_loss(out[0], t[0]);
      },
      pipeline::PipelineOptions().schedule("1f1b").num_microbatches(4).group(group));
  pipe.step({input}, {target});
  double difference = 0;
  const auto mine = stages->parameters();
  const auto theirs = reference->parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    difference = std::max(difference, worst(mine[i].grad(), theirs[i].grad()));
  }
  ok &= report("pipeline step (1f1b, 4 micro-batches): gradients", difference, 1e-5);
  return ok ? 0 : 1;
}
