#pragma once
// The tensor-parallel MLP: Linear (column) -> activation -> dropout -> Linear (row), one
// all-reduce forward and one backward (an all-gather and a reduce-scatter under sequence
// parallelism). Equals torch_mp::dense::MLP given the same weights.
//
// The forward is also the PyTorch operator torch.ops.torch_mp.parallel_mlp(x, fc1_weight,
// fc1_bias, fc2_weight, fc2_bias, training, *, <the options below>), a composition, which the
// Python module calls.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>

#include "torch_mp/dense.h"
#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"
#include "torch_mp/tensor_parallel/linear.h"

namespace torch_mp::tensor_parallel {

/// The options of ParallelMLP, declared once (torch_mp/options.h):
/// - hidden_size: input and output size;
/// - ffn_hidden_size: width of the inner layer; the group size must divide it;
/// - bias: biases on both layers;
/// - activation: "gelu" or "relu";
/// - dropout: after the activation (in training; the per-rank stream, see region_dropout);
/// - sequence_parallel: input and output split along the sequence dim (0);
/// - group: the tensor-parallel group; the default mesh's when null.
#define TORCH_MP_PARALLEL_MLP_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, hidden_size)                                 \
  REQUIRED(int64_t, ffn_hidden_size)                             \
  OPTION(bool, bias, true)                                       \
  OPTION(std::string, activation, "gelu")                        \
  OPTION(double, dropout, 0.0)                                   \
  OPTION(bool, sequence_parallel, false)                         \
  OPTION(GroupPtr, group, {})

/// Options of ParallelMLP.
struct ParallelMLPOptions {
  TORCH_MP_OPTIONS(ParallelMLPOptions, TORCH_MP_PARALLEL_MLP_OPTIONS)
};

/// Checks an MLP's configuration: a known activation ("gelu", "relu"), ffn_hidden_size divisible
/// by the group size (options.group(), which must be set), and the same options on every rank.
void check_parallel_mlp(const ParallelMLPOptions& options);

/// The options of an MLP's first layer (hidden -> ffn, column-parallel) and second layer
/// (ffn -> hidden, row-parallel).
ColumnParallelLinearOptions fc1_options(const ParallelMLPOptions& options);
RowParallelLinearOptions fc2_options(const ParallelMLPOptions& options);

/// This rank's parameters of an MLP: fc1's [ffn/t, h] weight (and [ffn/t] bias), fc2's
/// [h, ffn/t] weight (and whole [h] bias).
struct MLPParameters {
  at::Tensor fc1_weight;
  std::optional<at::Tensor> fc1_bias;
  at::Tensor fc2_weight;
  std::optional<at::Tensor> fc2_bias;
};

/// The forward of ParallelMLP (dropout only when `training`); `options.group()` must be set.
at::Tensor parallel_mlp(const at::Tensor& x,
                        const MLPParameters& parameters,
                        const ParallelMLPOptions& options,
                        bool training);

class ParallelMLP;

/// Linear (column) -> activation -> dropout -> Linear (row).
class ParallelMLPImpl : public torch::nn::Cloneable<ParallelMLPImpl> {
 public:
  ParallelMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size)
      : ParallelMLPImpl(ParallelMLPOptions(hidden_size, ffn_hidden_size)) {}
  explicit ParallelMLPImpl(ParallelMLPOptions options)
      : ParallelMLPImpl(std::move(options), /*initialise=*/true) {}
  void reset() override;
  /// Draws fc1 then fc2 as two torch::nn::Linear layers would be drawn.
  void reset_parameters();
  at::Tensor forward(const at::Tensor& x);
  /// The parameters as parallel_mlp takes them.
  MLPParameters weights() const;
  /// Shards the dense pair fc1 [ffn, h], fc2 [h, ffn].
  static ParallelMLP from_dense(const torch::nn::Linear& fc1,
                                const torch::nn::Linear& fc2,
                                ParallelMLPOptions options);
  /// Shards a torch_mp::dense::MLP (activation and dropout from it too).
  static ParallelMLP from_dense(const dense::MLP& mlp, ParallelMLPOptions options);
  /// Allocated, not initialised (for modules that fill it).
  static ParallelMLP uninitialised(ParallelMLPOptions options);
  /// Copies this rank's shards of the dense pair into the parameters.
  void load_dense(const torch::nn::Linear& fc1, const torch::nn::Linear& fc2);

  ParallelMLPOptions options;
  ColumnParallelLinear fc1 = nullptr;
  RowParallelLinear fc2 = nullptr;

 private:
  ParallelMLPImpl(ParallelMLPOptions options, bool initialise);
  bool initialise_ = true;
};
TORCH_MODULE(ParallelMLP);

}  // namespace torch_mp::tensor_parallel
