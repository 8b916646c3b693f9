#pragma once
// Vocabulary-parallel embedding: the rows of the [num_embeddings, embedding_dim] table are split
// across the tensor-parallel group.
//
// A vocabulary size V that the group size t does not divide is padded: every rank holds
// ceil(V / t) rows, rank r the ids [r * ceil(V / t), (r + 1) * ceil(V / t)), and the rows past V
// (on the last ranks) are zero and never looked up. Each rank embeds the ids it owns, writes
// zeros for the others, and the partial results are all-reduced.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <ostream>

#include "torch_mp/options.h"
#include "torch_mp/process_groups.h"

namespace torch_mp::tensor_parallel {

/// The ids one rank owns: [start, start + rows), of which the first `real` are vocabulary and
/// the rest padding.
struct VocabRange {
  int64_t start;
  /// Rows in every rank's shard: ceil(vocab_size / t).
  int64_t rows;
  /// Rows of this rank that are real vocabulary entries (the others are padding).
  int64_t real;
};

/// The part of a `vocab_size` vocabulary that `rank` of a group of `size` ranks owns.
VocabRange vocab_range(int64_t vocab_size, int64_t rank, int64_t size);
/// The part of the vocabulary this rank of `group` owns.
VocabRange vocab_range(int64_t vocab_size, const GroupPtr& group);

/// Forward of a vocabulary-parallel embedding: `weight` is this rank's [ceil(V / t), D] shard,
/// `input` holds ids in [0, num_embeddings) (the same on every rank). The gradient of a
/// `padding_idx` row stays zero, as in torch.nn.Embedding. Raises on ids out of range.
at::Tensor vocab_parallel_embedding(const at::Tensor& input,
                                    const at::Tensor& weight,
                                    int64_t num_embeddings,
                                    std::optional<int64_t> padding_idx,
                                    const GroupPtr& group);

/// Fills `weight` with this rank's rows of a dense table initialised as torch.nn.Embedding does
/// (standard normal, the padding_idx row zero); padding rows are zero.
void init_vocab_parallel_embedding_(at::Tensor& weight,
                                    int64_t num_embeddings,
                                    std::optional<int64_t> padding_idx,
                                    const GroupPtr& group);

/// Copies this rank's rows of the dense [num_embeddings, D] table into `weight` (padding rows
/// zeroed). Not differentiable.
void load_dense_embedding_(at::Tensor& weight, const at::Tensor& dense, const GroupPtr& group);

/// The dense [num_embeddings, D] table the ranks' shards make up (a collective).
at::Tensor gather_dense_embedding(const at::Tensor& weight,
                                  int64_t num_embeddings,
                                  const GroupPtr& group);

// ---- torch::nn module ------------------------------------------------------------------------

/// The options of VocabParallelEmbedding, declared once (torch_mp/options.h):
/// - num_embeddings: size of the vocabulary (of the dense table); any size, padded internally;
/// - embedding_dim: size of each embedding vector;
/// - padding_idx: an id whose row gets no gradient (and is initialised to zero); negative
///   counts from the end;
/// - group: the tensor-parallel group; the default mesh's when null.
#define TORCH_MP_VOCAB_PARALLEL_EMBEDDING_OPTIONS(REQUIRED, OPTION, KEYWORD) \
  REQUIRED(int64_t, num_embeddings)                                          \
  REQUIRED(int64_t, embedding_dim)                                           \
  OPTION(std::optional<int64_t>, padding_idx, std::nullopt)                  \
  OPTION(GroupPtr, group, {})

/// Options of VocabParallelEmbedding.
struct VocabParallelEmbeddingOptions {
  TORCH_MP_OPTIONS(VocabParallelEmbeddingOptions, TORCH_MP_VOCAB_PARALLEL_EMBEDDING_OPTIONS)
};

/// Checks an embedding's options (the same on every rank of options.group(), which must be
/// set; padding_idx in range).
void check_vocab_parallel_embedding(const VocabParallelEmbeddingOptions& options);

class VocabParallelEmbedding;

/// An Embedding whose vocabulary is split across the tensor-parallel group.
class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl> {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options)
      : VocabParallelEmbeddingImpl(std::move(options), /*initialise=*/true) {}

  void reset() override;
  /// Re-draws the table (see init_vocab_parallel_embedding_).
  void reset_parameters();
  /// Embeds `input` (see vocab_parallel_embedding).
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// Shards `dense`; the group is `group`, or the default mesh's when null.
  static VocabParallelEmbedding from_dense(const torch::nn::Embedding& dense, GroupPtr group = {});
  /// The dense table, gathered from every rank (a collective).
  torch::nn::Embedding to_dense() const;

  VocabParallelEmbeddingOptions options;
  /// This rank's [ceil(num_embeddings / t), embedding_dim] rows.
  at::Tensor weight;

 private:
  VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options, bool initialise);
  bool initialise_ = true;
};

/// Holder of VocabParallelEmbeddingImpl, used like torch::nn::Embedding.
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace torch_mp::tensor_parallel
