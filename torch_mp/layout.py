"""How parameters lie on the mesh: sharded along a dim over a group, or replicated over it.

Every parameter a torch_mp layer creates carries its layout (recorded in the C++ core, so both
front ends see the same); norms, clipping and checkpoints read it::

    layer = torch_mp.ColumnParallelLinear(16, 32)
    torch_mp.layout_of(layer.weight)   # ParameterLayout(sharded(dim=0)), over the tensor group
    torch_mp.layout_of(layer.bias)     # ParameterLayout(sharded(dim=0))
    torch_mp.layout_of(nn.Linear(4, 4).weight)   # None: a plain module's parameter, which
                                                 # torch_mp treats as replicated
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_mp import _C
from torch_mp._C import ParameterLayout
from torch_mp.mesh import get_mesh

__all__ = ["ParameterLayout", "layout_of", "set_layout"]


def layout_of(parameter: torch.Tensor) -> ParameterLayout | None:
    """The layout recorded for ``parameter``.

    Returns:
        A :class:`ParameterLayout` (``shard_dim``: the dense tensor's dim split over the group,
        None when replicated; ``group_name``; ``tied_copy``: the last stage's copy of a tied
        parameter; ``parts`` and ``dense_size`` as in :func:`set_layout`), or None for a
        parameter no torch_mp layer made; those count as replicated over the tensor-parallel
        group.
    """
    refuse_dtensors([parameter], "torch_mp.layout_of")
    return _C.layout_of(parameter)


def refuse_dtensors(parameters, what: str) -> None:
    """Raises if a parameter (of a module, or of a list) is a DTensor (PyTorch's
    ``fully_shard`` made it): torch_mp's clipping, layouts and checkpoints read plain tensors
    with the layouts torch_mp's layers give them, which ``fully_shard``'s DTensors replace.
    Every rank holds the same kinds of parameters, so every rank raises alike, before any
    collective."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    if isinstance(parameters, nn.Module):
        named = list(parameters.named_parameters())
    else:
        named = [(f"parameter {i}", p) for i, p in enumerate(parameters)]
    for name, p in named:
        if isinstance(p, DTensor):
            raise RuntimeError(
                f"{what}: {name} (shape {tuple(p.shape)}) is a DTensor, as PyTorch's "
                "fully_shard makes them: torch_mp's clipping, layouts and checkpoints need the "
                "plain parameters torch_mp's layers made (their tensor-parallel layouts are "
                "lost in the DTensor). Shard over the data group with torch_mp.DataParallel("
                "module, shard_parameters=True) instead (ZeRO-3, docs/memory.md), which keeps "
                "them"
            )


def set_layout(
    parameter: torch.Tensor,
    shard_dim: int | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    parts: int = 1,
    dense_size: int | None = None,
) -> None:
    """Records the layout of a parameter of your own module.

    Args:
        parameter: The parameter (this rank's shard of it, if sharded).
        shard_dim: The dense tensor's dim that is split across ``group`` (chunk ``rank`` on each
            rank); None when every rank of ``group`` holds the whole tensor.
        group: The group it is sharded or replicated over; the default mesh's tensor group.
        parts: How many equal parts the sharded dim holds, each split over ``group`` on its
            own (3 for a fused Q/K/V weight whose rows are this rank's rows of Q, of K, of V).
        dense_size: The dense tensor's size along ``shard_dim`` when the shards are padded
            past it (a vocabulary not divisible by the group); None when they tile it.

    Note:
        Record it again if you replace the parameter's tensor (torch_mp's own modules do so
        themselves after ``to``, ``to_empty``, ``load_state_dict(assign=True)`` and deepcopy).
    """
    group = group if group is not None else get_mesh().tp_group
    _C.set_layout(parameter, shard_dim, group.group_name, parts, dense_size)
