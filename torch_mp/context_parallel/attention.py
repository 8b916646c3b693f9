"""Attention over a sequence split across a context group: the face of
``csrc/torch_mp/context_parallel/attention.h``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_mp.context_parallel.sharding import _context_group

__all__ = ["METHODS", "attention"]

METHODS = ("ring", "all_gather", "all_to_all")

# all_gather agrees the ranks' parts through this operator before its gathers; compiled code must
# keep it even where the positions it returns go unused (no mask).
torch.fx.node.has_side_effect(torch.ops.torch_mp.context_part_positions.default)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    method: str = "ring",
    load_balance: bool = True,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's part of attention over the whole sequence, from this rank's parts of the
    queries, keys and values: equal to ``F.scaled_dot_product_attention`` on the whole
    sequence, cut as :func:`shard_sequence` cut it, forward and backward. Collective over the
    context group.

    Args:
        q: This rank's queries, ``[batch, heads, s / cp, head dim]``.
        k, v: This rank's keys and values, the same shape but for fewer heads that divide
            ``heads`` (grouped-query attention).
        is_causal: A causal mask over the whole sequence.
        scale: The scores' scale; ``1 / sqrt(head dim)`` when None.
        group: The context group; the default mesh's when None.
        method: ``"ring"``: K/V blocks passed around the ring point to point, each transfer
            overlapped with the previous block's compute, partial outputs merged by their
            log-sum-exp, blocks wholly in the future skipped under a causal mask, a second
            ring carrying dK/dV in the backward. ``"all_gather"``: K/V all-gathered.
            ``"all_to_all"``: Ulysses, from sequence-sharded to head-sharded and back (the
            heads and K/V heads must be divisible by cp).
        load_balance: Whether the sequence was cut load-balanced (:func:`shard_sequence`'s
            default). It must be the cut's: a mismatch cannot be detected.
        attn_mask: A mask for the whole sequence, as ``scaled_dot_product_attention`` would
            take it on the whole sequence (boolean: True takes part; float: added to the
            scores), broadcastable to ``[batch, heads, s, s]``; ``"all_gather"`` and
            ``"all_to_all"`` only.

    Returns:
        This rank's part of the output, ``[batch, heads, s / cp, head dim]``.

    Raises:
        RuntimeError: On every rank, if the ranks' shapes differ; if the heads do not divide
            as the method needs; for an unknown method, or a mask given to the ring.
    """
    return torch.ops.torch_mp.context_attention(
        q,
        k,
        v,
        _context_group(group).group_name,
        is_causal,
        scale,
        method,
        load_balance,
        attn_mask,
    )
