// Bindings of the tensor-parallel layers' set-up: configuration checks, initialisation, sharding
// and gathering dense tensors, the RNG tracker (torch_mp._C). The layers' forwards are PyTorch
// operators (torch.ops.torch_mp.*), not bindings. Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "python/common.h"
#include "python/layer_bindings.h"
#include "torch_mp/random.h"
#include "torch_mp/tensor_parallel/attention.h"
#include "torch_mp/tensor_parallel/conv.h"
#include "torch_mp/tensor_parallel/conv_block.h"
#include "torch_mp/tensor_parallel/cross_entropy.h"
#include "torch_mp/tensor_parallel/embedding.h"
#include "torch_mp/tensor_parallel/layer_norm.h"
#include "torch_mp/tensor_parallel/linear.h"
#include "torch_mp/tensor_parallel/mlp.h"
#include "torch_mp/tensor_parallel/sharding.h"
#include "torch_mp/tensor_parallel/transformer_layer.h"

namespace py = pybind11;
namespace tp = torch_mp::tensor_parallel;

namespace torch_mp::python {
namespace {

void bind_random(py::module_& m) {
  m.def(
      "rng_add",
      [](const std::string& name, uint64_t seed, const std::string& device) {
        rng_tracker().add(name, seed, c10::Device(device));
      },
      py::arg("name"),
      py::arg("seed"),
      py::arg("device"));
  m.def(
      "rng_has",
      [](const std::string& name, const std::string& device) {
        return rng_tracker().has(name, c10::Device(device));
      },
      py::arg("name"),
      py::arg("device"));
  m.def("rng_reset", [] { rng_tracker().reset(); });
  m.def("rng_states", [] { return rng_tracker().states(); });
  m.def(
      "rng_set_states",
      [](RngTracker::States states) { rng_tracker().set_states(std::move(states)); },
      py::arg("states"));
  m.def(
      "rng_swap_in",
      [](const std::string& name, const std::string& device) {
        return rng_tracker().swap_in(name, c10::Device(device));
      },
      py::arg("name"),
      py::arg("device"));
  m.def(
      "rng_swap_out",
      [](const std::string& name, const std::string& device, const at::Tensor& default_state) {
        rng_tracker().swap_out(name, c10::Device(device), default_state);
      },
      py::arg("name"),
      py::arg("device"),
      py::arg("default_state"));
  m.def(
      "model_parallel_manual_seed",
      [](uint64_t seed, const std::string& group, const std::string& device) {
        model_parallel_manual_seed(seed, resolve(group), c10::Device(device));
      },
      py::arg("seed"),
      py::arg("group"),
      py::arg("device"));
  m.attr("MODEL_PARALLEL_RNG") = kModelParallelRng;
}

void bind_sharding(py::module_& m) {
  m.def("divide", &tp::divide, py::arg("size"), py::arg("parts"), py::arg("what"));
  using Shard = at::Tensor (*)(const at::Tensor&, int64_t, const GroupPtr&);
  m.def("shard",
        by_group_name(static_cast<Shard>(&tp::shard)),
        py::arg("full"),
        py::arg("dim"),
        py::arg("group"));
  m.def("unshard",
        by_group_name(&tp::unshard),
        py::arg("local"),
        py::arg("dim"),
        py::arg("group"),
        ReleaseGil());
  m.def("init_sharded_like_dense_",
        by_group_name(&tp::init_sharded_like_dense_),
        py::arg("weight"),
        py::arg("bias"),
        py::arg("shard_dim"),
        py::arg("group"),
        ReleaseGil());
  m.def("load_dense_linear_",
        by_group_name(&tp::load_dense_linear_),
        py::arg("weight"),
        py::arg("bias"),
        py::arg("dense_weight"),
        py::arg("dense_bias"),
        py::arg("shard_dim"),
        py::arg("group"),
        ReleaseGil());
  m.def("gather_dense_linear",
        by_group_name(&tp::gather_dense_linear),
        py::arg("weight"),
        py::arg("bias"),
        py::arg("shard_dim"),
        py::arg("group"),
        ReleaseGil());
}

void bind_linear(py::module_& m) {
  bind_layer<tp::ColumnParallelLinearOptions>("ColumnParallelLinear",
                                              &tp::check_column_parallel_linear);
  bind_layer<tp::RowParallelLinearOptions>("RowParallelLinear", &tp::check_row_parallel_linear);
  m.def("init_parallel_linear_",
        by_group_name(&tp::init_parallel_linear_),
        py::arg("weight"),
        py::arg("bias"),
        py::arg("in_features"),
        py::arg("out_features"),
        py::arg("shard_dim"),
        py::arg("group"),
        ReleaseGil());
}

void bind_vocabulary(py::module_& m) {
  m.def(
      "vocab_range",
      [](int64_t vocab_size, const std::string& group) {
        const auto r = tp::vocab_range(vocab_size, resolve(group));
        return py::make_tuple(r.start, r.rows, r.real);
      },
      py::arg("vocab_size"),
      py::arg("group"));
  bind_layer<tp::VocabParallelEmbeddingOptions>("VocabParallelEmbedding",
                                                &tp::check_vocab_parallel_embedding);
  m.def("init_vocab_parallel_embedding_",
        by_group_name(&tp::init_vocab_parallel_embedding_),
        py::arg("weight"),
        py::arg("num_embeddings"),
        py::arg("padding_idx"),
        py::arg("group"));
  m.def("load_dense_embedding_",
        by_group_name(&tp::load_dense_embedding_),
        py::arg("weight"),
        py::arg("dense"),
        py::arg("group"));
  m.def("gather_dense_embedding",
        by_group_name(&tp::gather_dense_embedding),
        py::arg("weight"),
        py::arg("num_embeddings"),
        py::arg("group"),
        ReleaseGil());
  m.def("has_fused_cuda_kernels", &tp::has_fused_cuda_kernels);
}

void bind_conv(py::module_& m) {
  bind_layer<tp::ColumnParallelConv2dOptions>("ColumnParallelConv2d",
                                              &tp::check_column_parallel_conv2d);
  bind_layer<tp::RowParallelConv2dOptions>("RowParallelConv2d", &tp::check_row_parallel_conv2d);
}

void bind_blocks(py::module_& m) {
  bind_layer<tp::ParallelSelfAttentionOptions>(
      "ParallelSelfAttention",
      &tp::check_parallel_self_attention,
      {child("qkv", &tp::qkv_options), child("proj", &tp::proj_options)});
  bind_layer<tp::ParallelMLPOptions>(
      "ParallelMLP",
      &tp::check_parallel_mlp,
      {child("fc1", &tp::fc1_options), child("fc2", &tp::fc2_options)});
  bind_layer<tp::LayerNormOptions>("LayerNorm", &tp::check_layer_norm);
  bind_layer<tp::ParallelTransformerLayerOptions>("ParallelTransformerLayer",
                                                  &tp::check_parallel_transformer_layer,
                                                  {child("norm1", &tp::norm_options),
                                                   child("self_attn", &tp::attention_options),
                                                   child("norm2", &tp::norm_options),
                                                   child("mlp", &tp::mlp_options)});
  bind_layer<tp::ParallelConvBlockOptions>(
      "ParallelConvBlock",
      &tp::check_parallel_conv_block,
      {child("conv1", &tp::conv1_options), child("conv2", &tp::conv2_options)});
  m.def("load_dense_qkv_",
        by_group_name(&tp::load_dense_qkv_),
        py::arg("weight"),
        py::arg("bias"),
        py::arg("dense_weight"),
        py::arg("dense_bias"),
        py::arg("group"));
  m.def("gather_dense_qkv",
        by_group_name(&tp::gather_dense_qkv),
        py::arg("weight"),
        py::arg("bias"),
        py::arg("group"),
        ReleaseGil());
  // The C++ modules' tables of dense parameter names, for the Python modules of the same names.
  m.def(
      "dense_names",
      [](const std::string& module) {
        if (module == "ParallelSelfAttention") {
          return tp::ParallelSelfAttentionImpl::dense_names();
        }
        TORCH_CHECK(module == "ParallelTransformerLayer",
                    "torch_mp: no dense names for module '",
                    module,
                    "'");
        return tp::ParallelTransformerLayerImpl::dense_names();
      },
      py::arg("module"));
}

}  // namespace

void bind_tensor_parallel(py::module_& m) {
  bind_random(m);
  bind_sharding(m);
  bind_linear(m);
  bind_vocabulary(m);
  bind_conv(m);
  bind_blocks(m);
}

}  // namespace torch_mp::python
