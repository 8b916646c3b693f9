"""Optimizers over the mesh: :class:`DistributedOptimizer`, whose state is sharded over the
data-parallel ranks (ZeRO)."""

from torch_mp.optim.distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
