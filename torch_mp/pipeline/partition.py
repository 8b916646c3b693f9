"""Cutting an ``nn.Sequential`` into balanced pipeline stages (the balancing is the C++ core's)."""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from torch_mp._C import pipeline as _core


def partition(
    sequential: nn.Sequential,
    num_stages: int,
    balance: str | Sequence[int] = "params",
    sample_input: torch.Tensor | None = None,
) -> list[nn.Sequential]:
    """Cuts ``sequential`` into ``num_stages`` contiguous stages.

    Args:
        sequential: The model, as a sequence of layers.
        num_stages: How many stages to make.
        balance: ``"params"`` balances parameter counts; ``"time"`` balances the forward plus
            backward time of each layer measured on ``sample_input``; a list of integers gives
            the number of layers of each stage explicitly.
        sample_input: A batch for ``balance="time"``.

    Returns:
        One ``nn.Sequential`` per stage, holding the original layers (not copies) under their
        original names.

    Raises:
        ValueError: If the explicit sizes do not add up to the number of layers, or
            ``balance="time"`` lacks ``sample_input``.
        RuntimeError: If there are fewer layers than stages.
    """
    names = list(sequential._modules)
    layers = list(sequential)
    if isinstance(balance, str):
        if balance == "params":
            costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
        elif balance == "time":
            if sample_input is None:
                raise ValueError('partition: balance="time" needs sample_input')
            costs = _profile(layers, sample_input)
        else:
            raise ValueError(
                f"partition: balance must be 'params', 'time' or sizes, got {balance!r}"
            )
        sizes = _core.balanced_partition(costs, num_stages)
    else:
        sizes = [int(s) for s in balance]
        if len(sizes) != num_stages or sum(sizes) != len(layers) or min(sizes) < 1:
            raise ValueError(
                f"partition: sizes {sizes} must be {num_stages} positive numbers adding up to "
                f"the {len(layers)} layers"
            )
    stages, start = [], 0
    for size in sizes:
        stages.append(
            nn.Sequential(OrderedDict((names[i], layers[i]) for i in range(start, start + size)))
        )
        start += size
    return stages


def _profile(layers: list[nn.Module], sample_input: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median forward + backward time of each layer, fed with the previous layer's output.
    Copies of the layers are timed, so the model's gradients are left alone."""
    costs = []
    x = sample_input
    for layer in map(copy.deepcopy, layers):
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            begin = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            times.append(time.perf_counter() - begin)
        costs.append(sorted(times)[len(times) // 2])
        x = out.detach()
    return costs
