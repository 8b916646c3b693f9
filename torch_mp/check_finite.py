"""Opt-in NaN/Inf detection for models outside a Pipeline (the tensor-parallel blocks and
whatever surrounds them); ``Pipeline(..., check_finite=True)`` does the same per stage."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _rank() -> str:
    return f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""


def _check(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    nans = int(torch.isnan(tensor).sum())
    infs = tensor.numel() - nans - int(torch.isfinite(tensor).sum())
    raise RuntimeError(
        f"torch_mp.check_finite: non-finite values in {what}{_rank()}: {nans} NaN and {infs} "
        f"infinite entries of {tuple(tensor.shape)} {tensor.dtype}"
    )


class CheckFinite:
    """What :func:`check_finite` installed; ``remove()`` takes it away (also a context manager)."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> CheckFinite:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def check_finite(model: nn.Module, *, gradients: bool = True) -> CheckFinite:
    """Checks the output of every submodule of ``model`` for NaN and Inf as it is made, and
    with ``gradients`` the gradient arriving at each output in backward; the first one raises,
    naming the module (its path in ``model`` and its type), which output, the forward call
    (counting from 1 per module), the rank and the counts.

    Forward hooks fire innermost first, so the module named is the first that produced a
    non-finite value: a ``ColumnParallelLinear`` inside ``layers.3.mlp``, not the whole layer.
    Every rank checks its own tensors; replicated outputs (a row-parallel layer's) raise on every
    tensor-parallel rank alike. Costs a reduction per tensor, so use it to find a NaN, not in
    every run::

        with torch_mp.check_finite(model):
            loss = loss_fn(model(x), y)
            loss.backward()

    Returns:
        A handle whose ``remove()`` (or the end of the ``with`` block) takes the checks away.
    """
    handles = []
    for name, module in model.named_modules():
        path = name or "the model"
        label = f"{path} ({type(module).__name__})"
        calls = [0]

        def hook(module, inputs, output, label=label, calls=calls):
            calls[0] += 1
            for i, tensor in enumerate(_tensors(output)):
                _check(tensor, f"output {i} of {label}, forward call {calls[0]}")
                if gradients and tensor.requires_grad:
                    what = f"the gradient of output {i} of {label}, forward call {calls[0]}"
                    tensor.register_hook(lambda grad, what=what: _check(grad, what))

        handles.append(module.register_forward_hook(hook))
    return CheckFinite(handles)
