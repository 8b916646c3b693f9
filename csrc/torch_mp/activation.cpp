#include "torch_mp/activation.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace torch_mp {

void check_activation(const std::string& name) {
  TORCH_CHECK(name == "relu" || name == "gelu",
              "torch_mp: activation must be 'relu' or 'gelu', got '",
              name,
              "'");
}

at::Tensor activation(const at::Tensor& x, const std::string& name) {
  check_activation(name);
  return name == "gelu" ? at::gelu(x) : at::relu(x);
}

}  // namespace torch_mp
