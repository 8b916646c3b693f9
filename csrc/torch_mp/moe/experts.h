#pragma once
// The experts' activations (dense::Experts, moe::MoE): the MLPs' (activation.h), and the gated
// "swiglu" of Mixtral and LLaMA, silu(gate) * up, with fc1 holding the gate projection's rows
// and then the up projection's ([E, 2 ffn, hidden]).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace torch_mp::moe {

/// Raises "torch_mp: an expert's activation must be 'relu', 'gelu' or 'swiglu', got '<name>'".
void check_expert_activation(const std::string& name);

/// fc1's output rows per unit of ffn_hidden_size: 2 for "swiglu" (gate, then up), else 1.
int64_t fc1_rows_per_unit(const std::string& activation);

/// The activation of fc1's output `h` [n, rows]: silu(gate) * up of its two halves for
/// "swiglu", else activation.h's.
at::Tensor expert_activation(const at::Tensor& h, const std::string& name);

}  // namespace torch_mp::moe
