"""torch_mp.clip_grad_norm_ equals torch.nn.utils.clip_grad_norm_ on the dense model: sharded
parameters summed over the tensor group, replicated ones counted once, pipeline stages combined,
tied copies counted once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp
from torch_mp import pipeline

WIDTH = 8


def _dense(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH)
    )


def _sharded(dense: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(
        torch_mp.ColumnParallelLinear.from_dense(dense[0]),
        nn.GELU(),
        torch_mp.RowParallelLinear.from_dense(dense[2]),
        copy.deepcopy(dense[3]),  # a plain module: replicated
    )


def _clip_matches_dense(tp: int, pp: int, norm_type: float) -> None:
    mesh = use_mesh(tp, pp)
    denses = [_dense(seed) for seed in range(pp)]  # one block per pipeline stage
    model = _sharded(denses[mesh.pp_rank])
    x = rank_tensor(1, 0, 4, WIDTH)
    for block in denses:
        block(x).square().mean().backward()
    model(x).square().mean().backward()
    params = [p for block in denses for p in block.parameters()]
    max_norm = 0.05
    expected = nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    total = torch_mp.clip_grad_norm_(model.parameters(), max_norm, norm_type, mesh=mesh)
    assert_close(total, expected, "total norm")
    assert expected > max_norm, "the test must clip"
    ref = denses[mesh.pp_rank]
    t, r = mesh.tp_size, mesh.tp_rank
    assert_close(model[0].weight.grad, ref[0].weight.grad.chunk(t, 0)[r], "column weight")
    assert_close(model[0].bias.grad, ref[0].bias.grad.chunk(t, 0)[r], "column bias")
    assert_close(model[2].weight.grad, ref[2].weight.grad.chunk(t, 1)[r], "row weight")
    assert_close(model[2].bias.grad, ref[2].bias.grad, "row bias")
    assert_close(model[3].weight.grad, ref[3].weight.grad, "norm weight")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_matches_dense_over_the_tensor_group(norm_type, world):
    world.run(_clip_matches_dense, world.size, 1, norm_type)


def test_clip_combines_pipeline_stages(world4):
    world4.run(_clip_matches_dense, 2, 2, 2.0)


def _nonfinite() -> str | None:
    use_mesh(dist.get_world_size())
    layer = torch_mp.ColumnParallelLinear(WIDTH, 2 * WIDTH)
    layer(rank_tensor(1, 0, 2, WIDTH)).sum().backward()
    if dist.get_rank() == 0:
        layer.weight.grad[0, 0] = float("nan")
    return error_of(torch_mp.clip_grad_norm_, layer.parameters(), 1.0, error_if_nonfinite=True)


def test_nonfinite_norm_raises_on_every_rank(world):
    for message in world.run(_nonfinite):
        assert message is not None and "non-finite" in message


def _tied_copy_counted_once() -> None:
    mesh = use_mesh(1, pp=2)
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(5, WIDTH))
    mine = nn.Parameter(table.detach().clone())
    stage = nn.Linear(WIDTH, WIDTH)
    pipe = pipeline.Pipeline(
        stage, "1f1b", 1, nn.functional.mse_loss, mesh=mesh, tied_parameters=[mine]
    )
    layout = torch_mp.layout_of(mine)
    assert (layout is not None and layout.tied_copy) == (mesh.pp_rank == 1)
    mine.grad = torch.ones_like(mine)  # both copies hold the (summed) tied gradient
    stage.weight.grad = torch.zeros_like(stage.weight)
    stage.bias.grad = torch.zeros_like(stage.bias)
    total = torch_mp.clip_grad_norm_([mine, *stage.parameters()], 1e9, mesh=mesh)
    assert_close(total, torch.ones(5, WIDTH).norm(), "norm with the tied copy counted once")
    del pipe


def test_tied_copy_is_counted_once(world2):
    world2.run(_tied_copy_counted_once)
