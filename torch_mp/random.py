"""Random-number streams for tensor-parallel regions (the tracker is the C++ core's,
csrc/torch_mp/random.h).

Dropout on tensors every tensor-parallel rank holds whole must draw the same numbers on every
rank; dropout on a rank's own shard must draw different ones::

    torch_mp.random.manual_seed(1234)      # default stream: same on every rank of the group
    x = dropout(x)                         # outside a parallel region: identical masks
    with torch_mp.random.fork():           # per-rank stream (seed + 2718 + tp_rank)
        h = dropout(column_layer(x))       # inside: each rank masks its own shard differently

On leaving ``fork`` the default generator is exactly where it was, and the per-rank stream keeps
its advance for the next ``fork``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torch_mp import _C
from torch_mp.mesh import tp_group_name

MODEL_PARALLEL_RNG: str = _C.MODEL_PARALLEL_RNG

__all__ = ["MODEL_PARALLEL_RNG", "add", "fork", "manual_seed", "region_dropout", "reset"]


def _devices(device: torch.device | str | None) -> list[str]:
    """The given device, or the CPU plus the current CUDA device when there is one."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return [str(device)]
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append(f"cuda:{torch.cuda.current_device()}")
    return devices


def manual_seed(
    seed: int, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
) -> None:
    """Seeds the default generator with ``seed`` and the tensor-parallel stream with
    ``seed + 2718 + tp_rank``.

    Args:
        seed: The same on every rank.
        group: The tensor-parallel group; the default mesh's when None.
        device: The generator to seed; the CPU and the current CUDA device when None.
    """
    for d in _devices(device):
        _C.model_parallel_manual_seed(seed, tp_group_name(group), d)


def add(name: str, seed: int, device: torch.device | str | None = None) -> None:
    """Adds (or re-seeds) stream ``name``, for :func:`fork`."""
    for d in _devices(device):
        _C.rng_add(name, seed, d)


def reset() -> None:
    """Forgets every stream."""
    _C.rng_reset()


@contextlib.contextmanager
def fork(
    name: str = MODEL_PARALLEL_RNG, device: torch.device | str | None = None
) -> Iterator[None]:
    """Runs the body with stream ``name`` in place of the default generator.

    Raises:
        RuntimeError: If the stream was never seeded (see :func:`manual_seed`).
    """
    devices = _devices(device)
    saved = []
    try:
        for d in devices:
            saved.append((d, _C.rng_swap_in(name, d)))
        yield
    finally:
        for d, state in reversed(saved):
            _C.rng_swap_out(name, d, state)


def region_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout on a tensor that differs between the ranks (a shard, or sequence-parallel rows):
    the mask comes from the per-rank stream when :func:`manual_seed` set it up, else from the
    default generator; on the CPU it is the mask ``F.dropout`` would draw from that generator.
    The same under ``torch.compile`` (the operator ``torch.ops.torch_mp.region_dropout`` draws
    its mask at run time)."""
    return torch.ops.torch_mp.region_dropout(x, p, training)
