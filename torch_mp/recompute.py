"""Activation recomputation that replays torch_mp's random streams (the C++ core's
csrc/torch_mp/recompute.h; public as ``torch_mp.recompute``).

``torch.utils.checkpoint`` recomputes a forward from the default generators' states. Dropout
inside tensor-parallel regions draws from another stream, the per-rank stream of
:mod:`torch_mp.random`, which it does not restore: its recomputed masks would differ and the
gradients would be wrong. So the core refuses such a draw under ``torch.utils.checkpoint`` (with an
error that names this function), and :func:`recompute` replays that stream too::

    h = torch_mp.recompute(layer, x)       # layer's activations are not kept; backward
                                           # recomputes them with the same dropout masks

Under ``torch.compile`` a checkpointed region is recomputed by the compiled backward, which
replays the default generators' draws but not the per-rank stream's. There the per-rank stream's
noise (the operator ``torch_mp::region_dropout_noise``) is saved instead of recomputed, whatever
the region's policy, so ``torch.utils.checkpoint`` is exact over torch_mp layers in compiled code
too, and so is the core's recomputation (the layers' ``recompute`` option), which becomes such a
region when traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._higher_order_ops.wrap
import torch.fx.traceback
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy

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


# ---- under torch.compile --------------------------------------------------------------------


def _must_save(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


def _save_region_noise(mode: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """The per-rank stream's noise under a selective-checkpoint mode (torch.compile runs every
    checkpointed region through one): saved, never recomputed."""
    policy_fn = mode.policy_fn
    mode.policy_fn = _must_save
    try:
        return mode.__torch_dispatch__(func, types, args, kwargs)
    finally:
        mode.policy_fn = policy_fn


torch.library.register_torch_dispatch(
    "torch_mp::region_dropout_noise",
    torch.utils.checkpoint._CachingTorchDispatchMode,
    _save_region_noise,
)


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_contexts() -> tuple[Any, Any]:
    forward, recomputation = torch.utils.checkpoint.create_selective_checkpoint_contexts(
        _always_recompute
    )
    # The region's id in the traced graph, from the counter torch.compile's own checkpointed
    # regions draw theirs from (the partitioner orders regions by it).
    forward.ac_graph_id = next(torch._higher_order_ops.wrap.uid)
    return forward, recomputation


def _traced_recompute(function: Callable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The core's recompute() in traced code (torch.compile), where the streams cannot be
    replayed eagerly: a checkpointed region, which the compiled backward recomputes (the
    per-rank stream's noise saved, by the rule above). Through selective checkpointing's modes,
    which tracing sees inside an operator, as torch.compile's own checkpointed regions run."""
    # The region's tags in the traced nodes' metadata end with it.
    with torch.fx.traceback.preserve_node_meta():
        return torch.utils.checkpoint.checkpoint(
            function,
            inputs,
            use_reentrant=False,
            context_fn=_recompute_contexts,
            preserve_rng_state=False,
        )


_C.set_traced_recompute(_traced_recompute)
