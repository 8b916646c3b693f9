"""torch_mp.DataParallel, and data-parallel stages (DataParallel or DistributedDataParallel) in
the Pipeline: gradients equal those of one process running the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp import pipeline

WIDTH = 8


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def _accumulated_step_matches_reference(comm_hook, as_view) -> None:
    p, rank = dist.get_world_size(), dist.get_rank()
    mesh = use_mesh(1)  # dp = every rank
    reference = _mlp()
    model = _mlp(seed=rank)  # different on each rank: construction copies rank 0's
    dp = torch_mp.DataParallel(
        model, mesh=mesh, bucket_cap_mb=1e-4, gradient_as_bucket_view=as_view, comm_hook=comm_hook
    )
    for mine, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, ref), "parameters were not broadcast from rank 0"
    exact = comm_hook is None
    for step in range(3):  # the buckets are rebuilt after the first step
        x, y = rank_tensor(step, 0, 4 * p, WIDTH), rank_tensor(step + 10, 0, 4 * p, WIDTH)
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        dp.zero_grad()
        # This rank's quarter of the batch... in two micro-batches, the first under no_sync.
        mine_x, mine_y = x.chunk(p)[rank].chunk(2), y.chunk(p)[rank].chunk(2)
        with dp.no_sync():
            (nn.functional.mse_loss(dp(mine_x[0]), mine_y[0]) / 2).backward()
        (nn.functional.mse_loss(dp(mine_x[1]), mine_y[1]) / 2).backward()
        for (name, mine), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            if exact:
                assert_close(mine.grad, ref.grad, f"step {step} {name} gradient")
            else:  # 16-bit sums: rounding of that precision
                tol = 1e-2 if comm_hook == "bf16" else 2e-3
                torch.testing.assert_close(mine.grad, ref.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "comm_hook,as_view", [(None, False), (None, True), ("fp16", False), ("bf16", False)]
)
def test_data_parallel_matches_one_process(comm_hook, as_view, world):
    world.run(_accumulated_step_matches_reference, comm_hook, as_view)


def _buffers_follow_rank0() -> None:
    mesh = use_mesh(1)
    model = nn.Sequential(_mlp(), nn.BatchNorm1d(WIDTH))
    dp = torch_mp.DataParallel(model, mesh=mesh)
    x = rank_tensor(1, dist.get_rank(), 4, WIDTH)  # other data: other batch statistics
    dp(x).sum().backward()
    dp.prepare_for_forward()  # what the next step's forward does first
    stats = model[1].running_mean.clone()
    everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, stats)
    assert all(torch.equal(everyone[0], other) for other in everyone), "buffers differ"


def test_buffers_are_broadcast_before_each_synced_step(world2):
    world2.run(_buffers_follow_rank0)


def _mismatched_parameters_raise() -> str | None:
    use_mesh(1)
    width = WIDTH + dist.get_rank()  # rank 1's layer has another shape
    return error_of(torch_mp.DataParallel, nn.Linear(width, WIDTH))


def test_mismatched_parameters_raise_on_every_rank(world2):
    for message in world2.run(_mismatched_parameters_raise):
        assert message is not None


# ---- data-parallel pipeline stages -----------------------------------------------------------


def _stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)) for _ in range(n)
    ]


def _pipeline_stage_wrapped(name: str, spr: int, wrapper: str) -> None:
    mesh = use_mesh(1, pp=2)  # 4 ranks: pp 2 x dp 2
    n = 2 * spr
    stages = _stages(n)
    reference = copy.deepcopy(nn.Sequential(*stages))
    mine = stages[mesh.pp_rank :: 2]
    reductions = [0]

    def counting_hook(state, bucket):
        reductions[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    if wrapper == "ddp":
        wrapped = [DistributedDataParallel(s, process_group=mesh.dp_group) for s in mine]
        for module in wrapped:
            module.register_comm_hook(mesh.dp_group, counting_hook)
    else:
        wrapped = [torch_mp.DataParallel(s, mesh=mesh) for s in mine]
    m = 4
    pipe = pipeline.Pipeline(wrapped, name, m, loss_fn=nn.functional.mse_loss, mesh=mesh)
    for step in range(2):
        x, y = rank_tensor(step, 0, 4 * m, WIDTH), rank_tensor(step + 5, 0, 4 * m, WIDTH)
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        for module in mine:
            module.zero_grad()
        shard = slice(mesh.dp_rank * 2 * m, (mesh.dp_rank + 1) * 2 * m)
        pipe.step(
            x[shard] if mesh.pp_rank == 0 else None, target=y[shard] if mesh.pp_rank == 1 else None
        )
        for index, stage in zip(range(mesh.pp_rank, n, 2), mine, strict=True):
            for (pname, param), ref in zip(
                stage.named_parameters(), reference[index].parameters(), strict=True
            ):
                assert_close(param.grad, ref.grad, f"{name} step {step} stage {index} {pname}")
    if wrapper == "ddp":  # one bucket per stage: one all-reduce per stage and step
        assert reductions[0] == 2 * len(mine), reductions[0]


@pytest.mark.parametrize("wrapper", ["ddp", "torch_mp"])
@pytest.mark.parametrize(
    "name,spr", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]
)
def test_data_parallel_stage_is_exact_for_every_schedule(name, spr, wrapper, world4):
    world4.run(_pipeline_stage_wrapped, name, spr, wrapper)


def _unsupported_ddp_is_refused() -> str | None:
    mesh = use_mesh(1, pp=2)
    stage = DistributedDataParallel(
        _stages(1)[0], process_group=mesh.dp_group, find_unused_parameters=True
    )
    return error_of(pipeline.Pipeline, stage, "1f1b", 2, nn.functional.mse_loss, mesh=mesh)


def test_ddp_settings_the_pipeline_cannot_drive_are_refused(world4):
    for message in world4.run(_unsupported_ddp_is_refused):
        assert message is not None and "find_unused_parameters=True" in message
