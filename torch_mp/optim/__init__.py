"""Optimizers over the mesh: :class:`DistributedOptimizer`, whose state is sharded over the
data-parallel ranks (ZeRO), and :class:`GradScaler`, dynamic loss scaling for fp16 whose
overflow check every rank of the model agrees on."""

from torch_mp.optim.distributed_optimizer import DistributedOptimizer
from torch_mp.optim.grad_scaler import GradScaler

__all__ = ["DistributedOptimizer", "GradScaler"]
