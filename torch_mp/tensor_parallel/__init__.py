"""Tensor-parallel (intra-layer) modules."""

from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
