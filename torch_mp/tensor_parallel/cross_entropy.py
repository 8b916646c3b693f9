"""Cross-entropy over logits split along the vocabulary (the C++ core's
csrc/torch_mp/tensor_parallel/cross_entropy.h, fused CUDA kernels on GPU), reached as the
operator ``torch.ops.torch_mp.vocab_parallel_cross_entropy``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_mp import _C  # noqa: F401  (loads the operators)
from torch_mp.context_parallel.sharding import _context_group
from torch_mp.mesh import tp_group_name

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
    context_parallel: bool = False,
    context_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Cross-entropy over logits split along the last (vocabulary) dim, never gathered.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=...,
    label_smoothing=..., reduction=...)`` (reshaped as ``target`` for ``reduction="none"``),
    where ``full_logits`` is the ranks' ``logits`` concatenated along the last dim. Each rank
    keeps one shard-sized buffer (the softmax numerators, reused for the gradient) and
    exchanges ``4 x rows + 7`` numbers, not the logits.

    Args:
        logits: This rank's ``[..., V_local]`` shard.
        target: Class ids ``[...]``, the same on every rank, in ``[0, vocab_size)`` or
            ``ignore_index``.
        ignore_index: Target value that contributes neither loss nor gradient.
        label_smoothing: As in ``F.cross_entropy``, spread over the ``vocab_size`` real classes.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.
        group: The tensor-parallel group; the default mesh's when None.
        vocab_size: The real vocabulary size when shards are padded (as a
            :class:`VocabParallelEmbedding`'s are); padded entries get no probability. Default:
            every entry of every shard is vocabulary.
        context_parallel: The tokens are split over a context group
            (:mod:`torch_mp.context_parallel`): ``"mean"`` and ``"sum"`` are over the tokens of
            every rank of it, the same value on each (``"none"`` gives this rank's losses). The
            backward is the adjoint of that sum over the ranks: each rank's logits get the
            context group's summed gradient, ``cp`` times one process's, which
            :class:`torch_mp.DataParallel`'s averaging over data x context ranks divides again.
            One all-reduce of two numbers forward and of one backward.
        context_group: The context group; the default mesh's when None.

    Backward may run once per forward (the saved softmax becomes the gradient in place).
    """
    if context_group is not None and not context_parallel:
        raise ValueError(
            "vocab_parallel_cross_entropy: a context_group is given but context_parallel is off"
        )
    context = _context_group(context_group).group_name if context_parallel else ""
    return torch.ops.torch_mp.vocab_parallel_cross_entropy(
        logits,
        target,
        ignore_index,
        label_smoothing,
        reduction,
        vocab_size,
        tp_group_name(group),
        context,
    )
