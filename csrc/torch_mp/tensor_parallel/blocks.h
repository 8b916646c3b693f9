#pragma once
// The tensor-parallel building blocks, each in a file of its own: LayerNorm (layer_norm.h),
// self-attention with the heads split (attention.h), the MLP (mlp.h), the transformer layer
// (transformer_layer.h) and the convolutional block (conv_block.h).

#include "torch_mp/activation.h"                         // IWYU pragma: export
#include "torch_mp/tensor_parallel/attention.h"          // IWYU pragma: export
#include "torch_mp/tensor_parallel/conv_block.h"         // IWYU pragma: export
#include "torch_mp/tensor_parallel/layer_norm.h"         // IWYU pragma: export
#include "torch_mp/tensor_parallel/mlp.h"                // IWYU pragma: export
#include "torch_mp/tensor_parallel/transformer_layer.h"  // IWYU pragma: export
