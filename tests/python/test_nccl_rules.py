"""NCCL's rules, kept on Gloo (the collective checks on, which also refuse any tensor that does
not live on its group's device):

- the pipeline: every schedule made NCCL-safe, each run of sends and receives posted as one group,
  one tag for every message between two ranks (so Gloo, like NCCL, matches them by order alone);
- context parallelism: every method, the ring's send and receive posted as one group;
- expert parallelism: the counts and rows exchanged as tensors of the group's device.

Each result equals the one-process model's (or the whole sequence's), and a pipeline failure
still reaches every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import assert_close, error_of, rank_tensor, use_mesh
from test_context_parallel import HEADS, _attention_agrees
from test_moe import CASES as MOE_CASES
from test_moe import _step_equals_dense
from test_pipeline import WIDTH, _FailsAt, _model, _step_matches_reference, _WithPositions
from torch import nn

from torch_mp import context_parallel as cp
from torch_mp import functional, pipeline


def _checked(body, *args):
    """`body(*args)` with the collective checks on (a pipeline built there runs under NCCL's
    rules)."""
    functional.set_check_collectives(True)
    try:
        return body(*args)
    finally:
        functional.set_check_collectives(False)


@pytest.mark.parametrize(
    "name,stages_per_rank",
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("zb_h1", 1),
        ("interleaved_zb", 2),
        ("zbv", 2),
    ],
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_schedule_is_exact_under_nccl_rules(name, stages_per_rank, world_size, request):
    world = request.getfixturevalue(f"world{world_size}")
    world.run(_step_matches_reference, name, stages_per_rank, 2, 1, True)


def _layouts_that_change() -> None:
    # A new batch size sends a marker, the metadata and the data, in that order, on one tag.
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    torch.manual_seed(0)
    stages = [_WithPositions(True), _WithPositions(False)]
    reference = copy.deepcopy(stages)
    pipe = _checked(
        lambda: pipeline.Pipeline(
            stages[rank], "zb_h1", 2, loss_fn=nn.functional.mse_loss, mesh=mesh
        )
    )
    assert pipe.ordered
    for seed, rows in [(7, 8), (8, 12), (9, 4)]:
        x, y = rank_tensor(seed, 0, rows, WIDTH), rank_tensor(seed + 1, 0, rows, WIDTH)
        for module in (*stages, *reference):
            module.zero_grad()
        loss = sum(
            nn.functional.mse_loss(reference[1](*reference[0](xm)), ym)
            for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True)
        )
        (loss / 2).backward()
        got = pipe.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
        if rank == 1:
            assert_close(got, loss.detach() / 2, f"loss, {rows} rows")
        for param, ref in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True):
            assert_close(param.grad, ref.grad, f"gradient, {rows} rows")


def test_layouts_that_change_between_steps_arrive_exactly_under_nccl_rules(world2):
    world2.run(_layouts_that_change)


def _a_failure_reaches_every_rank() -> tuple[str | None, bool]:
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    stages = _model(2)
    reference = copy.deepcopy(nn.Sequential(*stages))
    failing = _FailsAt(stages[rank], fail_at=1 if rank == 1 else 99)
    pipe = _checked(
        lambda: pipeline.Pipeline(failing, "1f1b", 4, loss_fn=nn.functional.mse_loss, mesh=mesh)
    )
    other = rank_tensor(9, 0, 8, WIDTH)
    message = error_of(pipe.step, other if rank == 0 else None, target=other)
    pipe.reset()  # a fresh group: the failed step's markers may still queue on the old one
    for param in stages[rank].parameters():
        param.grad = None
    failing.fail_at = -1
    x, y = rank_tensor(1, 0, 8, WIDTH), rank_tensor(2, 0, 8, WIDTH)
    nn.functional.mse_loss(reference(x), y).backward()
    pipe.step(x if rank == 0 else None, target=y if rank == 1 else None)
    for param, ref in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True):
        assert_close(param.grad, ref.grad, "gradient after reset")
    return message, pipe.ordered


def test_a_failure_reaches_every_rank_and_reset_recovers_under_nccl_rules(world2):
    for message, ordered in world2.run(_a_failure_reaches_every_rank):
        assert "injected failure" in message and "F(1,1)" in message
        assert ordered


@pytest.mark.parametrize("method", cp.METHODS)
@pytest.mark.parametrize("world", [2, 4])
def test_every_context_parallel_method_is_exact_under_nccl_rules(method, world):
    for differences in get_world(world).run(
        _checked, _attention_agrees, world, method, True, True, None, HEADS
    ):
        for name, difference in differences.items():
            assert difference < 1e-5, (name, difference)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_moe_is_exact_under_nccl_rules(ep):
    case = next(iter(MOE_CASES))
    get_world(ep).run(_checked, _step_equals_dense, ep, MOE_CASES[case])
