"""The tensor-parallel building blocks under their former module name; each lives in a module
of its own, mirroring csrc/torch_mp/tensor_parallel/: :mod:`.layer_norm`, :mod:`.attention`,
:mod:`.mlp`, :mod:`.transformer_layer`, :mod:`.conv_block`."""

from torch_mp.tensor_parallel.attention import ParallelSelfAttention
from torch_mp.tensor_parallel.conv_block import ChannelParallelBatchNorm2d, ParallelConvBlock
from torch_mp.tensor_parallel.layer_norm import LayerNorm
from torch_mp.tensor_parallel.mlp import ParallelMLP
from torch_mp.tensor_parallel.transformer_layer import ParallelTransformerLayer

__all__ = [
    "ChannelParallelBatchNorm2d",
    "LayerNorm",
    "ParallelConvBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerLayer",
]
