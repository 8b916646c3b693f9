"""What the tensor-parallel block modules share: building children on the meta device and
giving them storage afterwards."""

from __future__ import annotations

import torch
from torch import nn


def materialise(module: nn.Module, device, dtype) -> None:
    """Gives a module built on the meta device real storage and initialises it (unless the caller
    asked for meta, as from_dense does before loading)."""
    if device is not None and torch.device(device).type == "meta":
        return
    module.to_empty(device=device if device is not None else "cpu")
    if dtype is not None:
        module.to(dtype=dtype)
    module.reset_parameters()


def empty_like_dense(dense: nn.Module, module: nn.Module) -> None:
    """Gives ``module`` (built on meta) storage on ``dense``'s device and dtype."""
    weight = next(dense.parameters())
    module.to_empty(device=weight.device)
    module.to(dtype=weight.dtype)
