"""torch_mp.check_finite: the first module whose output (or output gradient) is not finite is
named on every tensor-parallel rank; a clean run is untouched."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp

WIDTH = 8


class _InfGradient(torch.autograd.Function):
    """Identity whose backward turns the gradient infinite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class _PoisonsGradient(nn.Module):
    def forward(self, x):
        return _InfGradient.apply(x)


def _mlp(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        torch_mp.ColumnParallelLinear(WIDTH, 4 * WIDTH),
        middle,
        torch_mp.RowParallelLinear(4 * WIDTH, WIDTH),
    )


def _names_the_first_non_finite() -> tuple[str | None, str | None, bool]:
    use_mesh(dist.get_world_size())
    x = rank_tensor(1, 0, 4, WIDTH)
    model = _mlp(nn.GELU())
    bad = x.clone()
    bad[2, 3] = float("nan")
    with torch_mp.check_finite(model):
        forward = error_of(model, bad)
        clean = model(x).sum()  # a clean run passes
        clean.backward()
    model = _mlp(_PoisonsGradient())
    handle = torch_mp.check_finite(model)
    backward = error_of(lambda: model(x).sum().backward())
    handle.remove()
    model.zero_grad()
    model(x).sum().backward()  # removed: no check, the infinite gradient goes through
    removed = not bool(torch.isfinite(model[0].weight.grad).all())
    return forward, backward, removed


def test_the_first_non_finite_output_and_gradient_are_named(world):
    for rank, (forward, backward, removed) in enumerate(world.run(_names_the_first_non_finite)):
        assert forward is not None and "output 0 of 0 (ColumnParallelLinear)" in forward
        assert f"on rank {rank}" in forward and "forward call 1" in forward
        # Row 2 of the input is NaN: so is row 2 of this rank's 4 * WIDTH / t output features.
        assert f"{4 * WIDTH // world.size} NaN and 0 infinite entries" in forward, forward
        assert backward is not None, "an infinite gradient must raise"
        assert "the gradient of output 0 of 0 (ColumnParallelLinear)" in backward, backward
        assert removed


def _clean_results_are_unchanged() -> None:
    use_mesh(dist.get_world_size())
    x = rank_tensor(2, 0, 4, WIDTH)
    plain, checked = _mlp(nn.GELU()), _mlp(nn.GELU())
    plain(x).sum().backward()
    with torch_mp.check_finite(checked):
        checked(x).sum().backward()
    for a, b in zip(plain.parameters(), checked.parameters(), strict=True):
        assert_close(b.grad, a.grad, "gradient under check_finite")


def test_checking_changes_no_result(world2):
    world2.run(_clean_results_are_unchanged)
