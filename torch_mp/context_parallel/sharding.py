"""A sequence split across a context group: the face of
``csrc/torch_mp/context_parallel/sharding.h``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_mp import _C
from torch_mp.mesh import get_mesh

__all__ = ["sequence_positions", "shard_sequence", "unshard_sequence"]


def _context_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    group = get_mesh().cp_group
    if group is None:
        raise RuntimeError("torch_mp.context_parallel: the default mesh has no context group")
    return group


def shard_sequence(
    x: torch.Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    load_balance: bool = True,
) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``, ``x`` being the whole sequence (the same on
    every rank of the context group): with ``load_balance``, chunks r and 2 * cp - 1 - r of
    2 * cp, else chunk r of cp. Its backward puts the part's gradient in its place, zeros
    elsewhere: the context ranks hold different parts of the data, and DataParallel averages
    replicated parameters' gradients over data x context ranks: one process's gradients when
    each rank's loss is the mean over the whole sequence
    (``vocab_parallel_cross_entropy(..., context_parallel=True)``), or a mean over its part when
    the parts count as many tokens. Pass the same ``load_balance`` to
    :func:`attention`: a different one is not detectable, and gives wrong results.

    Args:
        x: The whole sequence (e.g. token ids ``[batch, s]`` or embeddings).
        dim: The sequence dim of ``x``.
        group: The context group; the default mesh's when None.
        load_balance: Cut for causal masks (every rank's queries then see as many keys).

    Raises:
        RuntimeError: On every rank, if the ranks' sequence lengths differ or the chunks do not
            divide the sequence.
    """
    return torch.ops.torch_mp.shard_sequence(x, dim, _context_group(group).group_name, load_balance)


def unshard_sequence(
    x: torch.Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None = None,
    load_balance: bool = True,
) -> torch.Tensor:
    """The whole sequence along ``dim`` from every rank's part ``x`` (as :func:`shard_sequence`
    cut it, with the same ``load_balance``); its backward sums the ranks' gradients of the
    whole into each part (a reduce-scatter), so that a loss over the joined sequence on every
    rank, averaged over the context ranks by DataParallel, gives one process's gradients."""
    return torch.ops.torch_mp.unshard_sequence(
        x, dim, _context_group(group).group_name, load_balance
    )


def sequence_positions(
    sequence_length: int,
    *,
    group: dist.ProcessGroup | None = None,
    load_balance: bool = True,
) -> torch.Tensor:
    """The positions (int64) of the whole sequence of ``sequence_length`` that this rank's part
    holds, in its order: :func:`shard_sequence` of ``torch.arange(sequence_length)``, without
    communicating. For rotary or learned position embeddings of a sharded sequence."""
    group = _context_group(group)
    return _C.context_parallel.sequence_positions(
        sequence_length, dist.get_rank(group), dist.get_world_size(group), load_balance
    )
