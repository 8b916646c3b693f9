#pragma once
// Cutting dense tensors into tensor-parallel shards and putting them back together.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

/// `size / parts`; raises, naming `what` (e.g. "ColumnParallelLinear: out_features"), unless
/// `parts` divides `size`.
int64_t divide(int64_t size, int64_t parts, const std::string& what);

/// Raises "<what> (<size>) must be non-negative" unless size >= 0.
void check_non_negative(int64_t size, const std::string& what);

/// Chunk `index` of `parts` equal chunks of `full` along `dim`, as a contiguous copy.
at::Tensor shard(const at::Tensor& full, int64_t dim, int64_t index, int64_t parts);

/// This rank's shard of `full` along `dim` for `group`.
at::Tensor shard(const at::Tensor& full, int64_t dim, const GroupPtr& group);

/// `t`, or nullopt when it is undefined (how modules hand an absent bias to the functions).
inline std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

/// Raises unless a layer's operator was given a bias exactly when its options' `bias()` says so
/// (the operators take both).
template <typename Options>
void check_bias_given(const Options& o, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(o.bias() == (bias && bias->defined()),
              Options::kName,
              ": the bias option is ",
              o.bias() ? "set" : "unset",
              " but a bias was ",
              o.bias() ? "not given" : "given");
}

/// `group`, or the default mesh's tensor-parallel group when `group` is null.
GroupPtr tp_group_or_default(const GroupPtr& group);

/// Raises unless a weight shard's `shard` size along its split dim is `full` split over the
/// group; `layer` and `what` (e.g. "ColumnParallelLinear", "out_features") name it.
void check_shard_size(
    const char* layer, const char* what, int64_t shard, int64_t full, const GroupPtr& group);

/// Fills `weight` (and `bias`) with this rank's shard of a dense Linear/Conv weight (and bias)
/// initialised exactly as torch.nn.Linear and torch.nn.Conv2d do: Kaiming-uniform(a = sqrt(5))
/// weight, uniform(+-1/sqrt(fan_in)) bias, drawn whole from the default generator. The dense
/// weight's shape is `weight`'s with dim `shard_dim` multiplied by the group size; the bias is
/// split like dim 0 when `shard_dim` is 0 and whole otherwise.
void init_sharded_like_dense_(at::Tensor& weight,
                              std::optional<at::Tensor> bias,
                              int64_t shard_dim,
                              const GroupPtr& group);

/// Restores the default CPU generator's state when it goes out of scope: a dense module built
/// only to receive gathered parameters (to_dense) must not change what the program draws next.
class KeepDefaultRng {
 public:
  KeepDefaultRng();
  ~KeepDefaultRng();
  KeepDefaultRng(const KeepDefaultRng&) = delete;
  KeepDefaultRng& operator=(const KeepDefaultRng&) = delete;

 private:
  at::Tensor state_;
};

/// The dense tensor whose shards along `dim` the ranks of `group` hold (an all-gather, not
/// differentiable). Every rank gets the whole tensor.
at::Tensor unshard(const at::Tensor& local, int64_t dim, const GroupPtr& group);

}  // namespace torch_mp::tensor_parallel
