"""Tensor-parallel (intra-layer) modules and functions: one module per idea, mirroring the C++
core's csrc/torch_mp/tensor_parallel/ (linear, conv, embedding, cross_entropy, layer_norm,
attention, mlp, transformer_layer, conv_block). The RNG tracker is :mod:`torch_mp.random`."""

from torch_mp.tensor_parallel.attention import ParallelSelfAttention
from torch_mp.tensor_parallel.conv import ColumnParallelConv2d, RowParallelConv2d
from torch_mp.tensor_parallel.conv_block import ChannelParallelBatchNorm2d, ParallelConvBlock
from torch_mp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from torch_mp.tensor_parallel.embedding import VocabParallelEmbedding
from torch_mp.tensor_parallel.layer_norm import LayerNorm
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from torch_mp.tensor_parallel.mlp import ParallelMLP
from torch_mp.tensor_parallel.transformer_layer import ParallelTransformerLayer

__all__ = [
    "ChannelParallelBatchNorm2d",
    "ColumnParallelConv2d",
    "ColumnParallelLinear",
    "LayerNorm",
    "ParallelConvBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerLayer",
    "RowParallelConv2d",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]
