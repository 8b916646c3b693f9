"""Tensor-parallel (intra-layer) modules and functions."""

from torch_mp.tensor_parallel.blocks import (
    ChannelParallelBatchNorm2d,
    LayerNorm,
    ParallelConvBlock,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerLayer,
)
from torch_mp.tensor_parallel.conv import ColumnParallelConv2d, RowParallelConv2d
from torch_mp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from torch_mp.tensor_parallel.embedding import VocabParallelEmbedding
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear

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
