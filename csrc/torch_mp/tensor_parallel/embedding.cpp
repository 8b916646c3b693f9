#include "torch_mp/tensor_parallel/embedding.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

std::optional<int64_t> normalised_padding_idx(std::optional<int64_t> padding_idx,
                                              int64_t num_embeddings) {
  if (!padding_idx) {
    return std::nullopt;
  }
  TORCH_CHECK(*padding_idx < num_embeddings && *padding_idx >= -num_embeddings,
              "VocabParallelEmbedding: padding_idx (",
              *padding_idx,
              ") must be within num_embeddings (",
              num_embeddings,
              ")");
  return *padding_idx < 0 ? *padding_idx + num_embeddings : *padding_idx;
}

// The operator vocab_local_ids: each id less `start` where this rank holds it ([start, start +
// real)), -1 where another rank does. Its kernel sees the ids' values (under torch.compile too,
// where the layer around it is traced) and raises unless all are in [0, num_embeddings).
at::Tensor vocab_local_ids(const at::Tensor& ids,
                           int64_t start,
                           int64_t real,
                           int64_t num_embeddings) {
  if (ids.numel() > 0) {
    const auto [lowest, highest] = at::aminmax(ids);
    TORCH_CHECK(lowest.item<int64_t>() >= 0 && highest.item<int64_t>() < num_embeddings,
                "VocabParallelEmbedding: ids must be in [0, ",
                num_embeddings,
                "), got ids in [",
                lowest.item<int64_t>(),
                ", ",
                highest.item<int64_t>(),
                "]");
  }
  const auto elsewhere = ids.lt(start).logical_or_(ids.ge(start + real));
  return (ids - start).masked_fill_(elsewhere, -1);
}

at::Tensor vocab_local_ids_meta(const at::Tensor& ids, int64_t, int64_t, int64_t) {
  return at::empty_like(ids);
}

at::Tensor vocab_parallel_embedding_op(const at::Tensor& input,
                                       const at::Tensor& weight,
                                       const VocabParallelEmbeddingOptions& o) {
  return vocab_parallel_embedding(input, weight, o.num_embeddings(), o.padding_idx(), o.group());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&vocab_parallel_embedding_op>(
      m, "vocab_parallel_embedding(Tensor input, Tensor weight)");
  m.def("vocab_local_ids(Tensor ids, int start, int real, int num_embeddings) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("vocab_local_ids", &vocab_local_ids);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) { m.impl("vocab_local_ids", &vocab_local_ids_meta); }

VocabRange vocab_range(int64_t vocab_size, int64_t rank, int64_t size) {
  TORCH_CHECK(vocab_size > 0 && size > 0 && rank >= 0 && rank < size,
              "torch_mp: a vocabulary of ",
              vocab_size,
              " entries cannot be split over ",
              size,
              " ranks (rank ",
              rank,
              ")");
  const int64_t rows = (vocab_size + size - 1) / size;
  const int64_t start = rank * rows;
  return {start, rows, std::clamp<int64_t>(vocab_size - start, 0, rows)};
}

VocabRange vocab_range(int64_t vocab_size, const GroupPtr& group) {
  return vocab_range(vocab_size, group->getRank(), group->getSize());
}

at::Tensor vocab_parallel_embedding(const at::Tensor& input,
                                    const at::Tensor& weight,
                                    int64_t num_embeddings,
                                    std::optional<int64_t> padding_idx,
                                    const GroupPtr& group) {
  comm::check_replicated(input, group, "VocabParallelEmbedding: the ids");
  const VocabRange range = vocab_range(num_embeddings, group);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == range.rows,
              "VocabParallelEmbedding: the weight shard has ",
              weight.size(0),
              " rows but a vocabulary of ",
              num_embeddings,
              " split over ",
              group->getSize(),
              " ranks needs ",
              range.rows,
              " per rank; the layer was built for a different group size");
  TORCH_CHECK(!at::isFloatingType(input.scalar_type()) && !input.is_complex(),
              "VocabParallelEmbedding: expected integer ids, got ",
              input.scalar_type());
  padding_idx = normalised_padding_idx(padding_idx, num_embeddings);
  int64_t local_padding_idx = -1;
  if (padding_idx && *padding_idx >= range.start && *padding_idx < range.start + range.real) {
    local_padding_idx = *padding_idx - range.start;
  }
  // Ids of other ranks (-1 here) look up row 0 and are then zeroed (their gradient with them).
  static const auto local_ids_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_mp::vocab_local_ids", "")
          .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  const auto local_ids = local_ids_op.call(input, range.start, range.real, num_embeddings);
  if (group->getSize() == 1) {
    return at::embedding(weight, local_ids, local_padding_idx);
  }
  const auto elsewhere = local_ids.lt(0);
  const auto partial = at::embedding(weight, local_ids.clamp_min(0), local_padding_idx)
                           .masked_fill(elsewhere.unsqueeze(-1), 0);
  return reduce_from_tp(partial, group);
}

void check_vocab_parallel_embedding(const VocabParallelEmbeddingOptions& o) {
  TORCH_CHECK(o.group(), "VocabParallelEmbedding: options.group() is not set");
  options::check_same_options(o, o.group(), "VocabParallelEmbedding");
  TORCH_CHECK(o.num_embeddings() > 0 && o.embedding_dim() >= 0,
              "VocabParallelEmbedding: num_embeddings must be positive and embedding_dim "
              "non-negative, got ",
              o.num_embeddings(),
              " and ",
              o.embedding_dim());
  normalised_padding_idx(o.padding_idx(), o.num_embeddings());
}

void init_vocab_parallel_embedding_(at::Tensor& weight,
                                    int64_t num_embeddings,
                                    std::optional<int64_t> padding_idx,
                                    const GroupPtr& group) {
  at::NoGradGuard no_grad;
  // The dense table drawn as nn.Embedding draws it, then our rows kept.
  auto dense = at::empty({num_embeddings, weight.size(1)}, weight.options()).normal_();
  if (const auto row = normalised_padding_idx(padding_idx, num_embeddings)) {
    dense[*row].zero_();
  }
  load_dense_embedding_(weight, dense, group);
}

void load_dense_embedding_(at::Tensor& weight, const at::Tensor& dense, const GroupPtr& group) {
  const VocabRange range = vocab_range(dense.size(0), group);
  TORCH_CHECK(dense.dim() == 2 && weight.dim() == 2 && weight.size(0) == range.rows &&
                  weight.size(1) == dense.size(1),
              "VocabParallelEmbedding: a [",
              weight.size(0),
              ", ",
              weight.size(-1),
              "] shard cannot hold its part of a dense table of shape ",
              dense.sizes());
  at::NoGradGuard no_grad;
  weight.zero_();
  if (range.real > 0) {  // the last ranks of a small vocabulary may hold padding only
    weight.narrow(0, 0, range.real).copy_(dense.narrow(0, range.start, range.real));
  }
}

at::Tensor gather_dense_embedding(const at::Tensor& weight,
                                  int64_t num_embeddings,
                                  const GroupPtr& group) {
  return unshard(weight, 0, group).narrow(0, 0, num_embeddings).clone();
}

// ---- VocabParallelEmbedding ------------------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options_,
                                                       bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  options.group(tp_group_or_default(options.group()));
  check_vocab_parallel_embedding(options);
  options.padding_idx(normalised_padding_idx(options.padding_idx(), options.num_embeddings()));
  const VocabRange range = vocab_range(options.num_embeddings(), options.group());
  weight = register_parameter("weight", at::empty({range.rows, options.embedding_dim()}));
  // This rank's rows of the vocabulary; the last ranks' rows past it are padding.
  set_layout(weight, ParameterLayout{0, options.group(), false, 1, options.num_embeddings()});
  if (initialise_) {
    reset_parameters();
  }
}

void VocabParallelEmbeddingImpl::reset_parameters() {
  init_vocab_parallel_embedding_(
      weight, options.num_embeddings(), options.padding_idx(), options.group());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& input) {
  return vocab_parallel_embedding(
      input, weight, options.num_embeddings(), options.padding_idx(), options.group());
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "torch_mp::VocabParallelEmbedding(" << options::describe(options)
         << ", tp_size=" << options.group()->getSize() << ")";
}

VocabParallelEmbedding VocabParallelEmbeddingImpl::from_dense(const torch::nn::Embedding& dense,
                                                              GroupPtr group) {
  const auto& dense_options = dense->options;
  TORCH_CHECK(
      !dense_options.max_norm() && !dense_options.scale_grad_by_freq() && !dense_options.sparse(),
      "VocabParallelEmbedding.from_dense: max_norm, scale_grad_by_freq and sparse are "
      "not supported");
  auto options =
      VocabParallelEmbeddingOptions(dense_options.num_embeddings(), dense_options.embedding_dim())
          .padding_idx(dense_options.padding_idx())
          .group(std::move(group));
  VocabParallelEmbedding layer(std::shared_ptr<VocabParallelEmbeddingImpl>(
      new VocabParallelEmbeddingImpl(std::move(options), /*initialise=*/false)));
  layer->weight.set_data(layer->weight.data().to(dense->weight.options()));
  load_dense_embedding_(layer->weight, dense->weight, layer->options.group());
  return layer;
}

torch::nn::Embedding VocabParallelEmbeddingImpl::to_dense() const {
  auto dense_weight = gather_dense_embedding(weight, options.num_embeddings(), options.group());
  auto dense_options =
      torch::nn::EmbeddingFromPretrainedOptions().freeze(false).padding_idx(options.padding_idx());
  return torch::nn::Embedding::from_pretrained(dense_weight, dense_options);
}

}  // namespace torch_mp::tensor_parallel
