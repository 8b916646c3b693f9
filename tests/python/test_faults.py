"""Faults: every rank raises fast, naming where the failure began, and the pipeline recovers.

Exceptions (a stage's forward, a backward, the loss) run in the pooled worlds: the processes
stay alive, as when a user catches the error. Deaths and stalls run in processes of their own,
launched directly (fault_worker.py), each with a deadline, so that a hang fails the test
instead of stalling the run. Every rank's message must name the failing rank, and the time to
raise must stay far below the group timeout (20 s in the pooled worlds).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from multiprocess import free_port
from reference import assert_close, rank_tensor, use_mesh
from torch import nn

from torch_mp import pipeline

WIDTH = 8
FAST_S = 5.0  # a failure reaches every rank within this (the group timeout is 20 s)


class _Injected(RuntimeError):
    pass


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise _Injected("injected failure in backward")


class _Faulty(nn.Module):
    """``module`` with a failure in the forward (or the backward) of micro-batch ``at``."""

    def __init__(self, module: nn.Module, where: str, at: int) -> None:
        super().__init__()
        self.module, self.where, self.at, self.calls = module, where, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 == self.at:
            if self.where == "forward":
                raise _Injected("injected failure in forward")
            return _RaisesInBackward.apply(self.module(x))
        return self.module(x)


def _fails_everywhere_then_recovers(
    name: str, stages_per_rank: int, failures: dict[int, tuple[str, int]]
) -> tuple[float, str]:
    """Each rank in ``failures`` fails (where, micro-batch) on its first stage; every rank must
    raise fast, then ``reset()`` and a clean step must equal the one-process model's."""
    rank, p = dist.get_rank(), dist.get_world_size()
    mesh = use_mesh(1, pp=p)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(p * stages_per_rank)]
    reference = copy.deepcopy(nn.Sequential(*stages))
    m = 2 * p
    schedule = pipeline.schedule(name, p * stages_per_rank, m, stages_per_rank)
    indices = schedule.stages_of_rank(rank)
    mine = [stages[i] for i in indices]
    where = failures.get(rank)
    loss_fn = nn.functional.mse_loss
    if where is not None and where[0] == "loss":

        def loss_fn(out, target, calls=[]):  # noqa: B006  (counts this rank's calls)
            calls.append(None)
            if len(calls) - 1 == where[1]:
                raise _Injected("injected failure in loss_fn")
            return nn.functional.mse_loss(out, target)

    elif where is not None:
        mine[0] = _Faulty(mine[0], *where)
    pipe = pipeline.Pipeline(mine, schedule, loss_fn=loss_fn, mesh=mesh)
    first, last = 0 in indices, len(stages) - 1 in indices
    bad_x, bad_y = rank_tensor(7, 0, 2 * m, WIDTH), rank_tensor(8, 0, 2 * m, WIDTH)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        pipe.step(bad_x if first else None, target=bad_y if last else None)
    seconds = time.monotonic() - start

    pipe.reset()  # every rank, whether its own step raised first or learnt it from a peer
    if isinstance(mine[0], _Faulty):
        mine[0].at = -1  # (the loss fails on one call only)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    x, y = rank_tensor(1, 0, 2 * m, WIDTH), rank_tensor(2, 0, 2 * m, WIDTH)
    expected = nn.functional.mse_loss(reference(x), y)
    expected.backward()
    loss = pipe.step(x if first else None, target=y if last else None)
    if last:
        assert_close(loss, expected.detach(), "loss after reset")
    for index, stage in zip(indices, mine, strict=True):
        for param, ref in zip(stage.parameters(), reference[index].parameters(), strict=True):
            assert_close(param.grad, ref.grad, f"stage {index} gradient after reset")
    return seconds, str(raised.value)


@pytest.mark.parametrize(
    "p,name,spr,where",
    [
        (2, "gpipe", 1, ("forward", 1)),
        (2, "zb_h1", 1, ("backward", 2)),
        (2, "1f1b", 1, ("loss", 1)),
        (4, "1f1b", 1, ("forward", 2)),
        (4, "zbv", 2, ("backward", 1)),
    ],
)
def test_one_rank_fails_every_rank_raises_fast_naming_it_then_reset_recovers(
    p, name, spr, where, request
):
    world = request.getfixturevalue(f"world{p}")
    # The loss lives on the last stage's rank (rank 0 in zbv's V); other faults on rank 1.
    schedule = pipeline.schedule(name, p * spr, 2 * p, spr)
    failing = schedule.rank_of_stage(p * spr - 1) if where[0] == "loss" else 1
    results = world.run(_fails_everywhere_then_recovers, name, spr, {failing: where})
    for rank, (seconds, message) in enumerate(results):
        assert seconds < FAST_S, f"rank {rank} took {seconds:.1f}s: {message}"
        assert f"injected failure in {where[0]}" in message, message
        assert f"rank {failing}" in message, message
        assert f"micro-batch {where[1]}" in message, message
        if rank != failing:
            assert f"the step failed on rank {failing}" in message, message


def test_every_rank_failing_at_a_different_microbatch_all_raise_then_recover(world2):
    # Stage 0 fails on micro-batch 3, after sending 0..2; stage 1 on micro-batch 1.
    results = world2.run(
        _fails_everywhere_then_recovers, "gpipe", 1, {0: ("forward", 3), 1: ("forward", 1)}
    )
    for rank, (seconds, message) in enumerate(results):
        assert seconds < FAST_S, message
        assert f"stage {rank} (rank {rank}) failed on micro-batch {3 - 2 * rank}" in message


def test_a_rank_that_had_finished_still_learns_of_a_later_failure(world2):
    # 1f1b: rank 1 finishes with its last backward before rank 0 runs its own last backward,
    # which fails; rank 1 learns it from the step's closing agreement.
    results = world2.run(_fails_everywhere_then_recovers, "1f1b", 1, {0: ("backward", 3)})
    assert "finished its step, but the step failed on rank 0" in results[1][1]


# ---- Deaths and stalls: processes of their own --------------------------------------------------


def _launch(case: str, world_size: int, timeout_s: float, deadline_s: float) -> dict[int, dict]:
    """Runs fault_worker.py's ``case`` on ``world_size`` fresh processes; returns the JSON each
    rank printed (the dead rank prints none). Kills everything past ``deadline_s``."""
    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(here, "fault_worker.py"), case, str(timeout_s)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    end = time.monotonic() + deadline_s
    outputs = {}
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"{case}: rank {rank} still running after {deadline_s}s (a hang)")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            outputs[rank] = json.loads(lines[-1])
        else:
            outputs[rank] = {"exit": proc.returncode, "stderr": err[-2000:]}
    return outputs


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", ["kill_forward", "kill_backward"])
def test_a_killed_rank_is_named_by_every_survivor_fast(case, world_size):
    # The group timeout is 60 s: raising within 15 s means the death was noticed, not waited out.
    outputs = _launch(case, world_size, timeout_s=60, deadline_s=90)
    assert outputs[1].get("exit") == -9, outputs[1]
    for rank in [0, *range(2, world_size)]:
        out = outputs[rank]
        assert out.get("raised"), out
        assert out["seconds"] < 15, out
        if "finished its step" in out["message"]:
            # Done before the death, this rank learns it from the step's closing agreement,
            # whose all-reduce cannot say which peer is gone.
            assert "did a peer's process die?" in out["message"], out["message"]
        else:
            assert "rank 1 (stage 1)" in out["message"], out["message"]
            assert "did its process die?" in out["message"], out["message"]
    assert "rank 1 (stage 1)" in outputs[0]["message"]  # it waits for rank 1's gradients


def test_a_stalled_rank_is_named_at_the_timeout_and_reset_recovers():
    # Rank 1 sleeps 2 s past the 4 s group timeout in a forward, then everyone resets (a fresh
    # group: the timeout closed Gloo's connections) and the next step is exact.
    outputs = _launch("stall", 2, timeout_s=4, deadline_s=90)
    survivor = outputs[0]
    assert survivor.get("raised"), survivor
    assert 3.5 < survivor["seconds"] < 15, survivor
    assert "rank 1 stalled" in survivor["message"], survivor["message"]
    assert outputs[1].get("raised"), outputs[1]
    assert all(out.get("recovered") for out in outputs.values()), outputs


def test_a_rank_killed_in_a_tensor_parallel_collective_ends_its_peers_fast():
    outputs = _launch("tp_kill", 2, timeout_s=60, deadline_s=90)
    assert outputs[1].get("exit") == -9, outputs[1]
    assert outputs[0].get("raised"), outputs[0]
    assert outputs[0]["seconds"] < 15, outputs[0]
    assert "did a peer's process die?" in outputs[0]["message"], outputs[0]["message"]
