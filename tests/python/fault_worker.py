"""One rank of a fault case, launched directly (no torchrun agent, which would kill the survivors
and hide what the library does). test_faults.py starts one process per rank with the
environment torch.distributed reads and reads back the one JSON line each prints.

    python fault_worker.py CASE GROUP_TIMEOUT_S

Cases (the victim is rank 1):

- ``kill_forward`` / ``kill_backward``: the victim's stage SIGKILLs its own process in the
  forward (backward) of micro-batch 1 of a 1f1b step;
- ``stall``: the victim's stage sleeps past the group timeout in the forward of micro-batch 1;
  then every rank calls ``Pipeline.reset()`` and runs a step, which must equal the one-process
  model's;
- ``tp_kill``: tensor parallelism (tp = world size): the victim SIGKILLs itself before a
  ``RowParallelLinear`` forward, whose all-reduce the others are in.

Each rank prints ``{"rank", "raised", "seconds", "message", "recovered"}``: whether and how fast
its step raised, the error's text, and (stall) whether the step after ``reset()`` was exact.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import torch_mp
from torch_mp import pipeline

VICTIM = 1
WIDTH = 8
MICROBATCHES = 4


class _Suicide(torch.autograd.Function):
    """Identity whose backward kills this process."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        os.kill(os.getpid(), signal.SIGKILL)
        return grad


class _Faulty(nn.Module):
    """``module``, with ``fault`` injected into its ``at``-th forward call (counting from 0)."""

    def __init__(self, module: nn.Module, fault: str, at: int, stall_s: float = 0.0) -> None:
        super().__init__()
        self.module, self.fault, self.at, self.stall_s, self.calls = module, fault, at, stall_s, 0

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 == self.at:
            if self.fault == "kill_forward":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "kill_backward":
                return _Suicide.apply(self.module(x))
            if self.fault == "stall":
                time.sleep(self.stall_s)
        return self.module(x)


def _pipeline_case(case: str, timeout_s: float) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    mesh = torch_mp.init(pp=p, timeout=timeout_s)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(p)]
    reference = copy.deepcopy(nn.Sequential(*stages))
    mine = stages[rank]
    if rank == VICTIM:
        mine = _Faulty(mine, case, at=1, stall_s=timeout_s + 2)
    pipe = pipeline.Pipeline(mine, "1f1b", MICROBATCHES, loss_fn=nn.functional.mse_loss, mesh=mesh)
    x, y = torch.randn(2 * MICROBATCHES, WIDTH), torch.randn(2 * MICROBATCHES, WIDTH)
    result = {"rank": rank, "raised": False, "message": "", "recovered": None}
    start = time.monotonic()
    try:
        pipe.step(x if rank == 0 else None, target=y if rank == p - 1 else None)
    except RuntimeError as e:
        result.update(raised=True, message=str(e))
    result["seconds"] = time.monotonic() - start
    if case == "stall":  # everyone survived: recover and check the next step
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        if rank == VICTIM:
            mine.at = -1
        pipe.reset()
        loss = pipe.step(x if rank == 0 else None, target=y if rank == p - 1 else None)
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        # The pipeline averages per micro-batch losses, the reference the whole batch's: equal
        # up to the order of the sums (the tolerance of the other tests).
        exact = all(
            torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
            for a, b in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True)
        )
        if rank == p - 1:
            exact = exact and torch.allclose(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        result["recovered"] = exact
    return result


def _tensor_parallel_case(timeout_s: float) -> dict:
    rank, t = dist.get_rank(), dist.get_world_size()
    torch_mp.init(tp=t, timeout=timeout_s)
    layer = torch_mp.RowParallelLinear(4 * t, WIDTH)
    result = {"rank": rank, "raised": False, "message": "", "recovered": None}
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        layer(torch.randn(2, 4))
    except RuntimeError as e:
        result.update(raised=True, message=str(e))
    result["seconds"] = time.monotonic() - start
    return result


def main() -> int:
    case, timeout_s = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    if case == "tp_kill":
        result = _tensor_parallel_case(timeout_s)
    else:
        result = _pipeline_case(case, timeout_s)
    print(json.dumps(result), flush=True)
    os._exit(0)  # survivors of a dead peer: do not wait for Gloo to tear down its connections


if __name__ == "__main__":
    sys.exit(main())
