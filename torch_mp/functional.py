"""Autograd-aware collectives over a tensor-parallel group: ``torch_mp.functional`` (named as
``torch.nn.functional``) is the face of the C++ core's csrc/torch_mp/collectives.h, registered as
PyTorch operators ``torch.ops.torch_mp.*``.

=====================  =====================  ================
op                     forward                backward
=====================  =====================  ================
copy_to_tp             identity               all-reduce
reduce_from_tp         all-reduce             identity
scatter_to_tp (dim)    split, keep own chunk  all-gather
gather_from_tp (dim)   all-gather             split
gather_from_sp (dim)   all-gather             reduce-scatter
reduce_scatter_to_sp   reduce-scatter         all-gather
=====================  =====================  ================

Every op takes ``group`` (a ``torch.distributed`` group; the default mesh's tensor group when
None) and is the identity on a group of one rank. Splitting ops raise ``RuntimeError`` when the
size along ``dim`` is not divisible by the group size. Eager code and ``torch.compile`` run the
same operators (their backward is the core's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_mp import _C
from torch_mp.mesh import tp_group_name

__all__ = [
    "check_collectives",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_tp",
    "set_check_collectives",
]

_ops = torch.ops.torch_mp


def set_check_collectives(on: bool) -> None:
    """Turns the collective checks on or off (default: the environment variable
    ``TORCH_MP_CHECK_COLLECTIVES=1`` turns them on).

    When on, every all-reduce, all-gather and reduce-scatter of torch_mp first compares the
    ranks' dtypes and shapes, and the tensor-parallel entry points that take a replicated tensor
    (``copy_to_tp``, hence a column layer's input; VocabParallelEmbedding's ids; the targets of
    ``vocab_parallel_cross_entropy``) compare its values. A rank holding another shape, dtype or
    batch then raises on every rank, quoting each rank's tensor, instead of aborting inside Gloo
    or returning numbers computed from mismatched data. The cost is one small all-gather per
    collective (and a pass over each replicated input), so it is meant for debugging and tests.
    Under ``torch.compile`` the values of replicated inputs are not compared (the graph is traced
    without values); shapes and dtypes still are.
    """
    _C.set_check_collectives(on)


def check_collectives() -> bool:
    """Whether the collective checks (:func:`set_check_collectives`) are on."""
    return _C.check_collectives()


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Identity forward; all-reduces the gradient. Enters a tensor-parallel region."""
    return _ops.copy_to_tp(x, tp_group_name(group))


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sums ``x`` over the group forward; identity backward. Leaves a tensor-parallel region."""
    return _ops.reduce_from_tp(x, tp_group_name(group))


def scatter_to_tp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = -1
) -> torch.Tensor:
    """Keeps this rank's chunk of ``x`` along ``dim``; all-gathers the gradient."""
    return _ops.scatter_to_tp(x, tp_group_name(group), dim)


def gather_from_tp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = -1
) -> torch.Tensor:
    """Concatenates every rank's ``x`` along ``dim``; keeps this rank's chunk of the gradient."""
    return _ops.gather_from_tp(x, tp_group_name(group), dim)


def gather_from_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 0
) -> torch.Tensor:
    """All-gathers a sequence-parallel tensor along the sequence ``dim`` (0 for ``[s, b, h]``);
    reduce-scatters the gradient."""
    return _ops.gather_from_sp(x, tp_group_name(group), dim)


def reduce_scatter_to_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 0
) -> torch.Tensor:
    """Sums ``x`` over the group and keeps this rank's chunk along the sequence ``dim``;
    all-gathers the gradient."""
    return _ops.reduce_scatter_to_sp(x, tp_group_name(group), dim)
