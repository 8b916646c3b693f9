"""torch_mp.recompute over tensor-parallel layers with dropout equals the same steps without
recomputation, bit for bit (outputs, gradients, and the random streams afterwards); plain
torch.utils.checkpoint over dropout in a tensor-parallel region is refused with an error that
names torch_mp.recompute, in both of its forms, and allowed where it is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from reference import error_of, rank_tensor, use_mesh

import torch_mp

SEQ, BATCH, HIDDEN, HEADS, FFN = 8, 2, 16, 4, 32


def _steps(how: str, dropout: float = 0.3, sequence_parallel: bool = False) -> list:
    """Two forward-backward steps of two ParallelTransformerLayers (tensor parallel over every
    rank) with ``how`` = "plain" (no recomputation), "recompute" (torch_mp.recompute around each
    layer), "full" / "selective" (the layers' recompute option), "checkpoint" / "reentrant"
    (torch.utils.checkpoint, non-reentrant / reentrant); returns the outputs, the input and
    parameter gradients, and a draw from each stream after."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        torch_mp.ParallelTransformerLayer(
            HIDDEN,
            HEADS,
            FFN,
            dropout=dropout,
            sequence_parallel=sequence_parallel,
            recompute=how if how in ("full", "selective") else None,
        )
        for _ in range(2)
    )
    torch_mp.random.manual_seed(1234)
    wrap = {
        "plain": lambda layer, x: layer(x),
        "full": lambda layer, x: layer(x),
        "selective": lambda layer, x: layer(x),
        "recompute": lambda layer, x: torch_mp.recompute(layer, x),
        "checkpoint": lambda layer, x: torch.utils.checkpoint.checkpoint(
            layer, x, use_reentrant=False
        ),
        "reentrant": lambda layer, x: torch.utils.checkpoint.checkpoint(
            layer, x, use_reentrant=True
        ),
    }[how]
    results = []
    for step in range(2):
        x = rank_tensor(step, 0, SEQ, BATCH, HIDDEN)
        if sequence_parallel:
            x = x.chunk(t, 0)[r]
        x = x.clone().requires_grad_()
        y = x
        for layer in layers:
            y = wrap(layer, y)
        (y * rank_tensor(10 + step, 0, *y.shape)).sum().backward()
        results += [y.detach(), x.grad] + [p.grad.clone() for p in layers.parameters()]
        layers.zero_grad()
    with torch_mp.random.fork():
        results.append(torch.rand(4))
    results.append(torch.rand(4))
    return results


def _recompute_equals_plain(how: str, sequence_parallel: bool) -> None:
    plain = _steps("plain", sequence_parallel=sequence_parallel)
    recomputed = _steps(how, sequence_parallel=sequence_parallel)
    assert len(plain) == len(recomputed)
    for i, (a, b) in enumerate(zip(plain, recomputed, strict=True)):
        assert torch.equal(a, b), (dist.get_rank(), i, (a - b).abs().max())
    # Dropout was on: without it the two steps' outputs would equal those of a model in eval().
    assert not torch.equal(plain[0], _steps("plain", dropout=0.0)[0])


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("how", ["recompute", "full", "selective"])
def test_recompute_with_dropout_equals_no_recompute_bit_for_bit(world, how, sequence_parallel):
    # torch_mp.recompute around each layer, and the layer's own recompute option.
    world.run(_recompute_equals_plain, how, sequence_parallel)


def _torch_checkpoint_is_refused(how: str) -> str | None:
    return error_of(_steps, how)


@pytest.mark.parametrize("how", ["checkpoint", "reentrant"])
def test_torch_checkpoint_over_region_dropout_is_refused_naming_recompute(world, how):
    # Non-reentrant: refused in the forward, under its saved-tensor hooks. Reentrant: its forward
    # runs without grad, so it is refused when the backward recomputes.
    for error in world.run(_torch_checkpoint_is_refused, how):
        assert error is not None and "torch_mp.recompute" in error, error
        assert "tensor-parallel region" in error, error


def _torch_checkpoint_is_exact_without_region_dropout() -> None:
    plain = _steps("plain", dropout=0.0)
    for how in ("checkpoint", "reentrant"):
        for a, b in zip(plain, _steps(how, dropout=0.0), strict=True):
            assert torch.equal(a, b)


def test_torch_checkpoint_without_dropout_is_allowed_and_exact(world2):
    world2.run(_torch_checkpoint_is_exact_without_region_dropout)


def _other_saved_tensor_hooks_are_not_refused() -> None:
    use_mesh(dist.get_world_size())
    torch_mp.random.manual_seed(1)
    layer = torch_mp.ParallelTransformerLayer(HIDDEN, HEADS, FFN, dropout=0.3)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():  # keeps the tensors it saves: nothing recomputed
        layer(x).sum().backward()
    assert x.grad is not None


def test_other_saved_tensor_hooks_are_not_refused(world2):
    world2.run(_other_saved_tensor_hooks_are_not_refused)


class _Stage(torch.nn.Module):
    """A pipeline stage of one ParallelTransformerLayer with dropout, on [b, s, h] micro-batches
    (the pipeline splits dim 0): ``how`` "plain", "recompute" (torch_mp.recompute around it) or
    the layer's recompute option ("full", "selective")."""

    def __init__(self, how: str) -> None:
        super().__init__()
        option = how if how in ("full", "selective") else None
        self.layer = torch_mp.ParallelTransformerLayer(
            HIDDEN, HEADS, FFN, dropout=0.3, recompute=option
        )
        self.recomputed = how == "recompute"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1)
        y = torch_mp.recompute(self.layer, x) if self.recomputed else self.layer(x)
        return y.transpose(0, 1)


def _pipeline_steps(schedule: str, how: str) -> list:
    mesh = use_mesh(2, 2)
    torch.manual_seed(0)
    stages = [_Stage(how) for _ in range(2)]
    mine = stages[mesh.pp_rank]
    pipe = torch_mp.pipeline.Pipeline(
        mine, schedule, 4, loss_fn=torch.nn.functional.mse_loss, mesh=mesh
    )
    torch_mp.random.manual_seed(1234)
    results = []
    for step in range(2):
        x = rank_tensor(step, 0, 4 * BATCH, SEQ, HIDDEN)
        target = rank_tensor(10 + step, 0, 4 * BATCH, SEQ, HIDDEN)
        loss = pipe.step(x, target=target)
        results += [torch.tensor(0.0) if loss is None else torch.as_tensor(loss)]
        results += [p.grad.clone() for p in mine.parameters()]
        mine.zero_grad()
    return results


def _pipeline_recompute_equals_plain(schedule: str, how: str) -> None:
    plain = _pipeline_steps(schedule, "plain")
    for a, b in zip(plain, _pipeline_steps(schedule, how), strict=True):
        assert torch.equal(a, b), (dist.get_rank(), (a - b).abs().max())


@pytest.mark.parametrize("how", ["recompute", "full", "selective"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_recompute_in_pipeline_stages_equals_no_recompute(world4, schedule, how):
    # tp 2 x pp 2. zb_h1 splits each backward into B and W: torch_mp.recompute (torch's
    # saved-tensor hooks) recomputes in each; the layer's option once, in B, keeping the
    # recomputed graph's weight work for W.
    world4.run(_pipeline_recompute_equals_plain, schedule, how)
