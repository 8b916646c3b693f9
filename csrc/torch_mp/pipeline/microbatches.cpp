// A batch split into micro-batches, and the outputs joined back (microbatches.h).

#include "torch_mp/pipeline/microbatches.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace torch_mp::pipeline {

std::vector<std::vector<at::Tensor>> split_microbatches(const std::vector<at::Tensor>& batch,
                                                        int64_t num_microbatches) {
  TORCH_CHECK(
      num_microbatches > 0, "Pipeline: num_microbatches must be positive, got ", num_microbatches);
  std::vector<std::vector<at::Tensor>> result(num_microbatches);
  for (const auto& t : batch) {
    TORCH_CHECK(t.dim() > 0 && t.size(0) % num_microbatches == 0,
                "Pipeline: the batch size (",
                t.dim() > 0 ? t.size(0) : 0,
                ") of a ",
                describe_tensors({t}),
                " tensor must be divisible by num_microbatches (",
                num_microbatches,
                ")");
    auto chunks = t.chunk(num_microbatches, 0);
    for (int64_t m = 0; m < num_microbatches; ++m) {
      result[m].push_back(chunks[m]);
    }
  }
  return result;
}

std::vector<at::Tensor> join_microbatches(
    const std::vector<std::vector<at::Tensor>>& microbatches) {
  std::vector<at::Tensor> joined;
  for (size_t i = 0; !microbatches.empty() && i < microbatches[0].size(); ++i) {
    std::vector<at::Tensor> parts;
    for (const auto& microbatch : microbatches) {
      parts.push_back(microbatch[i]);
    }
    joined.push_back(at::cat(parts, 0));
  }
  return joined;
}

std::string describe_tensors(const std::vector<at::Tensor>& tensors) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < tensors.size(); ++i) {
    out << (i ? ", " : "") << tensors[i].scalar_type() << tensors[i].sizes();
  }
  out << "]";
  return out.str();
}

}  // namespace torch_mp::pipeline
