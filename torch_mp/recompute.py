"""Activation recomputation that replays torch_mp's random streams (the C++ core's
csrc/torch_mp/recompute.h; public as ``torch_mp.recompute``).

``torch.utils.checkpoint`` recomputes a forward from the default generators' states. Dropout
inside tensor-parallel regions draws from another stream, the per-rank stream of
:mod:`torch_mp.random`, which it does not restore: its recomputed masks would differ and the
gradients would be wrong. So the core refuses such a draw under ``torch.utils.checkpoint`` (with an
error that names this function), and :func:`recompute` replays that stream too::

    h = torch_mp.recompute(layer, x)       # layer's activations are not kept; backward
                                           # recomputes them with the same dropout masks
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from torch_mp import _C

__all__ = ["recompute"]


def _under_torch_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are torch.utils.checkpoint's (asked by the core
    before a draw from the per-rank stream)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    module = getattr(hooks[0], "__module__", None) if hooks is not None else None
    return module == torch.utils.checkpoint.__name__


_C.set_checkpoint_hooks_probe(_under_torch_checkpoint)


class _Replaying:
    """A context ``torch.utils.checkpoint`` enters around the first run (``first_run`` None) or
    around each recomputation of that run (its ``context_fn``). The first notes the tracker's
    streams; a recomputation puts them back, and afterwards the streams of the moment. Both let
    the core draw from the tracker (a ``RecomputeScope``)."""

    def __init__(self, first_run: _Replaying | None = None) -> None:
        self.first_run = first_run
        self.streams: dict | None = None
        self._entered: list[tuple[_C.RecomputeScope, dict | None]] = []

    def __enter__(self) -> None:
        now = _C.rng_states()
        if self.first_run is None:
            self.streams, restore = now, None
        else:
            _C.rng_set_states(self.first_run.streams)
            restore = now
        scope = _C.RecomputeScope()
        scope.__enter__()
        self._entered.append((scope, restore))

    def __exit__(self, *exc: object) -> bool:
        scope, restore = self._entered.pop()
        scope.__exit__(None, None, None)
        if restore is not None:
            _C.rng_set_states(restore)
        return False


def _contexts() -> tuple[_Replaying, _Replaying]:
    first = _Replaying()
    return first, _Replaying(first)


def recompute(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its activations: the backward runs it again
    and differentiates that, as ``torch.utils.checkpoint.checkpoint(function, *args,
    use_reentrant=False)`` does, with every random stream as it was at the first run, torch_mp's
    per-rank stream included, so dropout draws the same masks and the gradients equal those of
    the run without recomputation.

    Args:
        function: Runs the forward (a module, or any function of tensors).
        args, kwargs: Its arguments.

    Returns:
        What ``function`` returns.
    """
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=_contexts, **kwargs
    )
