// The experts' activations (experts.h).

#include "torch_mp/moe/experts.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "torch_mp/activation.h"

namespace torch_mp::moe {

void check_expert_activation(const std::string& name) {
  TORCH_CHECK(name == "relu" || name == "gelu" || name == "swiglu",
              "torch_mp: an expert's activation must be 'relu', 'gelu' or 'swiglu', got '",
              name,
              "'");
}

int64_t fc1_rows_per_unit(const std::string& activation) { return activation == "swiglu" ? 2 : 1; }

at::Tensor expert_activation(const at::Tensor& h, const std::string& name) {
  if (name != "swiglu") {
    return activation(h, name);
  }
  const auto halves = h.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

}  // namespace torch_mp::moe
