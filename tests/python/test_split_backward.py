"""Zero-bubble split backward (csrc/torch_mp/split_backward.h): B and W each do their own
share of a backward once, and stay exact when a parameter is shared inside a stage."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, rank_tensor, use_mesh
from torch import nn

from torch_mp import pipeline

WIDTH = 8


class _Counted(torch.autograd.Function):
    """Identity that counts how often its backward runs (per process)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Counted.calls += 1
        return grad


class _Stage(nn.Module):
    """Linear -> counted -> tanh -> Linear: the counted node sits on the activation-gradient path
    between the two weights."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = self.first if shared else nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.second(torch.tanh(_Counted.apply(self.first(x))))


def _split_backward(shared: bool) -> int:
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    torch.manual_seed(0)
    stages = [_Stage(shared), _Stage(shared)]
    reference = copy.deepcopy(stages)
    m = 4
    x, y = rank_tensor(1, 0, 2 * m, WIDTH), rank_tensor(2, 0, 2 * m, WIDTH)
    nn.functional.mse_loss(reference[1](reference[0](x)), y).backward()
    pipe = pipeline.Pipeline(stages[rank], "zb_h1", m, loss_fn=nn.functional.mse_loss, mesh=mesh)
    _Counted.calls = 0
    pipe.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
    for param, ref in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True):
        assert_close(param.grad, ref.grad, "gradient")
    return _Counted.calls


def test_b_and_w_walk_the_activation_path_once(world2):
    # The last stage (rank 1) splits its backward: one pass through the counted node per
    # micro-batch, at B. A W that walked the graph again from the outputs would make it two.
    first, last = world2.run(_split_backward, False)
    assert last == 4, last
    assert first == 4, first  # the first stage runs its whole backward at B


@pytest.mark.parametrize("shared", [True])
def test_a_parameter_shared_inside_a_stage_stays_exact(shared, world2):
    # The shared weight feeds two weight nodes: W runs as one backward from the outputs.
    world2.run(_split_backward, shared)


@pytest.mark.parametrize("shared", [False, True])
def test_backward_input_then_weight_equals_one_backward_in_one_process(shared):
    # The functions the executor runs, called directly: B gives the input gradient and no
    # parameter gradient, W then gives every parameter gradient; each counted node runs once.
    torch.manual_seed(0)
    stage = _Stage(shared)
    reference = copy.deepcopy(stage)
    x = torch.randn(4, WIDTH)
    dout = torch.randn(4, WIDTH)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(dout)

    leaf = x.clone().requires_grad_()
    _Counted.calls = 0
    (dx,), work = pipeline.backward_input([stage(leaf)], [dout], [leaf], list(stage.parameters()))
    assert all(p.grad is None for p in stage.parameters())
    assert_close(dx, x_ref.grad, "input gradient")
    pipeline.backward_weight(work)
    assert _Counted.calls == 1
    for (name, param), ref in zip(stage.named_parameters(), reference.parameters(), strict=True):
        assert_close(param.grad, ref.grad, f"{name} gradient")
