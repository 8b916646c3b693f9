"""Helpers shared by test bodies: deterministic per-rank data and fp32 comparisons."""

from __future__ import annotations

import torch
import torch.distributed as dist
from multiprocess import GROUP_TIMEOUT_S

# fp32 tolerances for every parallel-vs-dense comparison. rtol 1e-5 as the standard asks; atol
# covers entries near zero, where a sum taken in a different order (the all-reduce of partial
# products) differs by a few ulps of the *other* terms.
RTOL = 1e-5
ATOL = 1e-6


def rank_tensor(seed: int, rank: int, *shape: int) -> torch.Tensor:
    """A tensor any process can compute for any rank (references need no communication)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(*shape, generator=g)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL
) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}"
    )


def error_of(fn, *args, **kwargs) -> str | None:
    """The message of the RuntimeError/ValueError ``fn`` raises, or None if it returns."""
    try:
        fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


_meshes: dict[tuple[int, int, int, int], object] = {}


def use_mesh(tp: int, pp: int = 1, cp: int = 1, ep: int = 1):
    """The default mesh for (tp, pp, cp, ep) in this worker, built once and reused by later test
    bodies (each torch_mp.init makes new groups, and Gloo groups hold threads and sockets)."""
    import torch_mp

    key = (tp, pp, cp, ep)
    if key not in _meshes:
        _meshes[key] = torch_mp.init(tp=tp, pp=pp, cp=cp, ep=ep, timeout=GROUP_TIMEOUT_S)
    torch_mp.set_mesh(_meshes[key])
    return _meshes[key]
