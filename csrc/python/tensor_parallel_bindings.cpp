// Bindings of the tensor-parallel layers beyond Linear: embedding, cross-entropy, Conv2d and the
// building blocks (torch_mp._C). Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "torch_mp/tensor_parallel/blocks.h"
#include "torch_mp/tensor_parallel/conv.h"
#include "torch_mp/tensor_parallel/cross_entropy.h"
#include "torch_mp/tensor_parallel/embedding.h"
#include "torch_mp/tensor_parallel/linear.h"
#include "torch_mp/tensor_parallel/random.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace py = pybind11;
namespace tp = torch_mp::tensor_parallel;

namespace torch_mp::python {
namespace {

using Pair = std::array<int64_t, 2>;

// nn.Conv2d's arguments as the core's Conv2dOptions. `padding` is a pair or "same"/"valid".
torch::nn::Conv2dOptions conv2d_options(int64_t in_channels,
                                        int64_t out_channels,
                                        Pair kernel_size,
                                        Pair stride,
                                        const std::variant<Pair, std::string>& padding,
                                        Pair dilation,
                                        int64_t groups,
                                        bool bias,
                                        const std::string& padding_mode) {
  auto options = torch::nn::Conv2dOptions(in_channels, out_channels, kernel_size)
                     .stride(stride)
                     .dilation(dilation)
                     .groups(groups)
                     .bias(bias);
  if (const auto* pair = std::get_if<Pair>(&padding)) {
    options.padding(*pair);
  } else if (std::get<std::string>(padding) == "same") {
    options.padding(torch::kSame);
  } else {
    TORCH_CHECK(std::get<std::string>(padding) == "valid",
                "Conv2d: padding must be a pair of numbers, 'same' or 'valid', got '",
                std::get<std::string>(padding),
                "'");
    options.padding(torch::kValid);
  }
  if (padding_mode == "reflect") {
    options.padding_mode(torch::kReflect);
  } else if (padding_mode == "replicate") {
    options.padding_mode(torch::kReplicate);
  } else if (padding_mode == "circular") {
    options.padding_mode(torch::kCircular);
  } else {
    TORCH_CHECK(padding_mode == "zeros",
                "Conv2d: padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got '",
                padding_mode,
                "'");
  }
  return options;
}

}  // namespace

void bind_tensor_parallel(py::module_& m) {
  // ---- random-number streams ----
  m.def(
      "rng_add",
      [](const std::string& name, uint64_t seed, const std::string& device) {
        tp::rng_tracker().add(name, seed, c10::Device(device));
      },
      py::arg("name"),
      py::arg("seed"),
      py::arg("device"));
  m.def(
      "rng_has",
      [](const std::string& name, const std::string& device) {
        return tp::rng_tracker().has(name, c10::Device(device));
      },
      py::arg("name"),
      py::arg("device"));
  m.def("rng_reset", [] { tp::rng_tracker().reset(); });
  m.def(
      "rng_swap_in",
      [](const std::string& name, const std::string& device) {
        return tp::rng_tracker().swap_in(name, c10::Device(device));
      },
      py::arg("name"),
      py::arg("device"));
  m.def(
      "rng_swap_out",
      [](const std::string& name, const std::string& device, const at::Tensor& default_state) {
        tp::rng_tracker().swap_out(name, c10::Device(device), default_state);
      },
      py::arg("name"),
      py::arg("device"),
      py::arg("default_state"));
  m.def(
      "model_parallel_manual_seed",
      [](uint64_t seed, const std::string& group, const std::string& device) {
        tp::model_parallel_manual_seed(seed, resolve(group), c10::Device(device));
      },
      py::arg("seed"),
      py::arg("group"),
      py::arg("device"));
  m.attr("MODEL_PARALLEL_RNG") = tp::kModelParallelRng;

  // ---- sharding ----
  m.def(
      "load_dense_linear_",
      [](at::Tensor weight,
         std::optional<at::Tensor> bias,
         const at::Tensor& dense_weight,
         const std::optional<at::Tensor>& dense_bias,
         int64_t shard_dim,
         const std::string& group) {
        tp::load_dense_linear_(weight, bias, dense_weight, dense_bias, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("dense_weight"),
      py::arg("dense_bias"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "gather_dense_linear",
      [](const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t shard_dim,
         const std::string& group) {
        return tp::gather_dense_linear(weight, bias, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());
  m.def("divide", &tp::divide, py::arg("size"), py::arg("parts"), py::arg("what"));

  // ---- parallel linear ----
  m.def(
      "column_parallel_linear",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t out_features,
         bool gather_output,
         bool sequence_parallel,
         const std::string& group) {
        return tp::column_parallel_linear(
            input, weight, bias, out_features, gather_output, sequence_parallel, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("out_features"),
      py::arg("gather_output"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "row_parallel_linear",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         int64_t in_features,
         bool input_is_parallel,
         bool sequence_parallel,
         const std::string& group) {
        return tp::row_parallel_linear(
            input, weight, bias, in_features, input_is_parallel, sequence_parallel, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("in_features"),
      py::arg("input_is_parallel"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_column_parallel_linear",
      [](int64_t in_features,
         int64_t out_features,
         bool bias,
         bool gather_output,
         bool sequence_parallel,
         const std::string& group) {
        tp::check_column_parallel_linear(
            in_features, out_features, bias, gather_output, sequence_parallel, resolve(group));
      },
      py::arg("in_features"),
      py::arg("out_features"),
      py::arg("bias"),
      py::arg("gather_output"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_row_parallel_linear",
      [](int64_t in_features,
         int64_t out_features,
         bool bias,
         bool input_is_parallel,
         bool sequence_parallel,
         const std::string& group) {
        tp::check_row_parallel_linear(
            in_features, out_features, bias, input_is_parallel, sequence_parallel, resolve(group));
      },
      py::arg("in_features"),
      py::arg("out_features"),
      py::arg("bias"),
      py::arg("input_is_parallel"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "init_parallel_linear_",
      [](at::Tensor weight,
         std::optional<at::Tensor> bias,
         int64_t in_features,
         int64_t out_features,
         int64_t shard_dim,
         const std::string& group) {
        tp::init_parallel_linear_(
            weight, bias, in_features, out_features, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("in_features"),
      py::arg("out_features"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());

  // ---- sharding helpers ----
  m.def(
      "shard",
      [](const at::Tensor& full, int64_t dim, const std::string& group) {
        return tp::shard(full, dim, resolve(group));
      },
      py::arg("full"),
      py::arg("dim"),
      py::arg("group"));
  m.def(
      "unshard",
      [](const at::Tensor& local, int64_t dim, const std::string& group) {
        return tp::unshard(local, dim, resolve(group));
      },
      py::arg("local"),
      py::arg("dim"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "init_sharded_like_dense_",
      [](at::Tensor weight,
         std::optional<at::Tensor> bias,
         int64_t shard_dim,
         const std::string& group) {
        tp::init_sharded_like_dense_(weight, bias, shard_dim, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("shard_dim"),
      py::arg("group"),
      ReleaseGil());

  // ---- embedding ----
  m.def(
      "vocab_range",
      [](int64_t vocab_size, const std::string& group) {
        const auto r = tp::vocab_range(vocab_size, resolve(group));
        return py::make_tuple(r.start, r.rows, r.real);
      },
      py::arg("vocab_size"),
      py::arg("group"));
  m.def(
      "vocab_parallel_embedding",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         int64_t num_embeddings,
         std::optional<int64_t> padding_idx,
         const std::string& group) {
        return tp::vocab_parallel_embedding(
            input, weight, num_embeddings, padding_idx, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("num_embeddings"),
      py::arg("padding_idx"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_vocab_parallel_embedding",
      [](int64_t num_embeddings,
         int64_t embedding_dim,
         std::optional<int64_t> padding_idx,
         const std::string& group) {
        tp::check_vocab_parallel_embedding(
            num_embeddings, embedding_dim, padding_idx, resolve(group));
      },
      py::arg("num_embeddings"),
      py::arg("embedding_dim"),
      py::arg("padding_idx"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "init_vocab_parallel_embedding_",
      [](at::Tensor weight,
         int64_t num_embeddings,
         std::optional<int64_t> padding_idx,
         const std::string& group) {
        tp::init_vocab_parallel_embedding_(weight, num_embeddings, padding_idx, resolve(group));
      },
      py::arg("weight"),
      py::arg("num_embeddings"),
      py::arg("padding_idx"),
      py::arg("group"));
  m.def(
      "load_dense_embedding_",
      [](at::Tensor weight, const at::Tensor& dense, const std::string& group) {
        tp::load_dense_embedding_(weight, dense, resolve(group));
      },
      py::arg("weight"),
      py::arg("dense"),
      py::arg("group"));
  m.def(
      "gather_dense_embedding",
      [](const at::Tensor& weight, int64_t num_embeddings, const std::string& group) {
        return tp::gather_dense_embedding(weight, num_embeddings, resolve(group));
      },
      py::arg("weight"),
      py::arg("num_embeddings"),
      py::arg("group"),
      ReleaseGil());

  // ---- cross-entropy ----
  m.def(
      "vocab_parallel_cross_entropy",
      [](const at::Tensor& logits,
         const at::Tensor& target,
         int64_t ignore_index,
         double label_smoothing,
         const std::string& reduction,
         std::optional<int64_t> vocab_size,
         const std::string& group) {
        return tp::vocab_parallel_cross_entropy(
            logits, target, resolve(group), ignore_index, label_smoothing, reduction, vocab_size);
      },
      py::arg("logits"),
      py::arg("target"),
      py::arg("ignore_index"),
      py::arg("label_smoothing"),
      py::arg("reduction"),
      py::arg("vocab_size"),
      py::arg("group"),
      ReleaseGil());

  // ---- Conv2d ----
  // The geometry of a dense Conv2d, built once per layer and handed to every forward.
  py::class_<torch::nn::Conv2dOptions>(m, "Conv2dGeometry")
      .def(py::init(&conv2d_options),
           py::arg("in_channels"),
           py::arg("out_channels"),
           py::arg("kernel_size"),
           py::arg("stride"),
           py::arg("padding"),
           py::arg("dilation"),
           py::arg("groups"),
           py::arg("bias"),
           py::arg("padding_mode"))
      .def("__copy__", [](const torch::nn::Conv2dOptions& self) { return self; })
      .def("__deepcopy__",
           [](const torch::nn::Conv2dOptions& self, const py::dict&) { return self; });
  m.def(
      "check_parallel_conv2d",
      [](const torch::nn::Conv2dOptions& dense,
         int64_t shard_dim,
         bool flag,
         const std::string& group) {
        tp::check_parallel_conv2d(dense, shard_dim, flag, resolve(group));
      },
      py::arg("geometry"),
      py::arg("shard_dim"),
      py::arg("flag"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "column_parallel_conv2d",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         const torch::nn::Conv2dOptions& dense,
         bool gather_output,
         const std::string& group) {
        return tp::column_parallel_conv2d(
            input, weight, bias, dense, gather_output, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("geometry"),
      py::arg("gather_output"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "row_parallel_conv2d",
      [](const at::Tensor& input,
         const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         const torch::nn::Conv2dOptions& dense,
         bool input_is_parallel,
         const std::string& group) {
        return tp::row_parallel_conv2d(
            input, weight, bias, dense, input_is_parallel, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("geometry"),
      py::arg("input_is_parallel"),
      py::arg("group"),
      ReleaseGil());

  // ---- building blocks ----
  m.def(
      "layer_norm",
      [](const at::Tensor& input,
         const std::optional<at::Tensor>& weight,
         const std::optional<at::Tensor>& bias,
         double eps,
         bool sequence_parallel,
         const std::string& group) {
        return tp::layer_norm(input, weight, bias, eps, sequence_parallel, resolve(group));
      },
      py::arg("input"),
      py::arg("weight"),
      py::arg("bias"),
      py::arg("eps"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "attention_heads",
      [](const at::Tensor& qkv,
         int64_t num_heads,
         const std::string& group,
         const std::optional<at::Tensor>& attn_mask,
         bool is_causal,
         double dropout_p) {
        return tp::attention_heads(qkv, num_heads, resolve(group), attn_mask, is_causal, dropout_p);
      },
      py::arg("qkv"),
      py::arg("num_heads"),
      py::arg("group"),
      py::arg("attn_mask"),
      py::arg("is_causal"),
      py::arg("dropout_p"));
  m.def("has_fused_cuda_kernels", &tp::has_fused_cuda_kernels);
  m.def("region_dropout", &tp::region_dropout, py::arg("x"), py::arg("p"), py::arg("training"));
  m.def("activation", &tp::activation, py::arg("x"), py::arg("name"));
  m.def(
      "check_parallel_self_attention",
      [](int64_t hidden_size,
         int64_t num_heads,
         bool bias,
         double dropout,
         bool sequence_parallel,
         const std::string& group) {
        tp::check_parallel_self_attention(
            hidden_size, num_heads, bias, dropout, sequence_parallel, resolve(group));
      },
      py::arg("hidden_size"),
      py::arg("num_heads"),
      py::arg("bias"),
      py::arg("dropout"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_parallel_mlp",
      [](int64_t hidden_size,
         int64_t ffn_hidden_size,
         bool bias,
         const std::string& activation,
         double dropout,
         bool sequence_parallel,
         const std::string& group) {
        tp::check_parallel_mlp(hidden_size,
                               ffn_hidden_size,
                               bias,
                               activation,
                               dropout,
                               sequence_parallel,
                               resolve(group));
      },
      py::arg("hidden_size"),
      py::arg("ffn_hidden_size"),
      py::arg("bias"),
      py::arg("activation"),
      py::arg("dropout"),
      py::arg("sequence_parallel"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_parallel_transformer_layer",
      [](bool norm_first, double layer_norm_eps, const std::string& group) {
        tp::check_parallel_transformer_layer(norm_first, layer_norm_eps, resolve(group));
      },
      py::arg("norm_first"),
      py::arg("layer_norm_eps"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "check_parallel_conv_block",
      [](int64_t in_channels,
         int64_t mid_channels,
         int64_t out_channels,
         int64_t kernel_size,
         int64_t padding,
         bool bias,
         const std::string& group) {
        tp::check_parallel_conv_block(
            in_channels, mid_channels, out_channels, kernel_size, padding, bias, resolve(group));
      },
      py::arg("in_channels"),
      py::arg("mid_channels"),
      py::arg("out_channels"),
      py::arg("kernel_size"),
      py::arg("padding"),
      py::arg("bias"),
      py::arg("group"),
      ReleaseGil());
  m.def(
      "load_dense_qkv_",
      [](at::Tensor weight,
         std::optional<at::Tensor> bias,
         const at::Tensor& dense_weight,
         const std::optional<at::Tensor>& dense_bias,
         const std::string& group) {
        tp::load_dense_qkv_(weight, bias, dense_weight, dense_bias, resolve(group));
      },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("dense_weight"),
      py::arg("dense_bias"),
      py::arg("group"));
  m.def(
      "gather_dense_qkv",
      [](const at::Tensor& weight,
         const std::optional<at::Tensor>& bias,
         const std::string& group) { return tp::gather_dense_qkv(weight, bias, resolve(group)); },
      py::arg("weight"),
      py::arg("bias"),
      py::arg("group"),
      ReleaseGil());
}

}  // namespace torch_mp::python
