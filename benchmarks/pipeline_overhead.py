"""Pipeline overhead: measured step time over the simulated ideal, torch_mp beside
torch.distributed.pipelining, for the same schedules, stages and micro-batches.

Run on CPU with Gloo (4 ranks; two cores are enough, since the stages only sleep)::

    .venv/bin/torchrun --standalone --nproc-per-node=4 \\
        benchmarks/pipeline_overhead.py

Every stage's compute is a fixed sleep, so the ideal step time is exactly what
``pipeline.simulate`` computes for these costs, and any time above it is the library's overhead
(Python and C++ bookkeeping, Gloo point-to-point, waiting for a peer that was late):

- F: forward of a stage, sleeps ``FORWARD``;
- B: input gradient, sleeps ``BACKWARD``; W: weight gradient, sleeps ``WEIGHT``;
  a full backward (gpipe, 1f1b, interleaved_1f1b) does both, ``BACKWARD + WEIGHT``.

The two halves of the backward are separate autograd nodes (``_SleepInput`` on the path to the
stage input, ``_SleepWeight`` on the path to the parameter), so zero-bubble schedules really run
them apart. On the first stage a scale parameter puts the B node on the parameters' path, so
that stage pays its B like the others (see ``SleepStage``), as the cost model assumes. Each rank
holds the same share of the model in every schedule: with two stages per rank
(interleaved_1f1b, 8 stages) each stage sleeps half as long.

For each schedule and each library: two warm-up steps, then ``STEPS`` steps, each between two
barriers; the table shows the median. torch.distributed.pipelining has no ZB-H1 class: its
``ScheduleInterleavedZeroBubble`` with one stage per rank is the ZB1P (= ZB-H1) schedule of the
zero-bubble paper, so that is what the zb_h1 row compares against. It places some W's
differently from torch_mp's zb_h1 (rank 0 runs each W right after its B), but replayed with
``pipeline.simulate`` at these costs its makespan is the same, so the ideal column holds for both.

"ideal as run" is ``simulate`` with the mean F, B, W (or BW) durations torch_mp's traces
measured: with 4 processes on 2 cores a 10 ms sleep inside a stage takes about 10.5 ms, which
no library can help; the ratio to it is what the library itself adds (communication, waiting,
bookkeeping).

Rank 0 prints the table and writes, under ``docs/``, the simulated zb_h1 and 1f1b timelines and
torch_mp's measured 1f1b and zb_h1 timelines (every rank's trace gathered to rank 0; each rank's
times are shifted by when that rank entered ``step``, so small differences in start time show).
Times in the pictures are in units of one forward (``FORWARD`` seconds).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pipeline_cases import CASES, Case, ends_on_rank  # beside this script
from torch import nn
from torch.distributed import pipelining as torch_pipelining

import torch_mp
from torch_mp import pipeline

NUM_RANKS = 4
NUM_MICROBATCHES = 16
MICROBATCH_SIZE = 4
WIDTH = 16
FORWARD = 0.010  # seconds
BACKWARD = 0.010
WEIGHT = 0.010
WARMUP_STEPS = 2
STEPS = 3
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")


class _SleepInput(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` forward and ``backward_s`` on the input gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """Zeros shaped like ``weight``; its backward (the weight gradient, zero) sleeps
    ``weight_s``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s = weight_s
        return torch.zeros_like(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.weight_s)
        return torch.zeros_like(grad), None


class SleepStage(nn.Module):
    """A stage whose F, B and W cost fixed sleeps: ``out = x + 0 * weight``, computed slowly.

    The batch needs no gradient, so on the first stage nothing asks for the input gradient and
    its B would sleep in no library. There a ``scale`` parameter (1.0) sits in front of the
    ``_SleepInput`` node: the parameter gradients then pass through that node, and the first
    stage does its B's sleep like every other stage, as part of its backward.
    """

    def __init__(self, forward_s: float, backward_s: float, weight_s: float, first: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(WIDTH))
        self.scale = nn.Parameter(torch.ones(())) if first else None
        self.costs = (forward_s, backward_s, weight_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward_s, backward_s, weight_s = self.costs
        if self.scale is not None:
            x = x * self.scale
        return _SleepInput.apply(x, forward_s, backward_s) + _SleepWeight.apply(
            self.weight, weight_s
        )


def costs(case: Case) -> tuple[float, float, float]:
    """A stage's (F, B, W) seconds: a rank's share of the model is the same in every case."""
    return (
        FORWARD / case.stages_per_rank,
        BACKWARD / case.stages_per_rank,
        WEIGHT / case.stages_per_rank,
    )


def schedule_of(case: Case) -> pipeline.Schedule:
    return case.schedule(NUM_RANKS, NUM_MICROBATCHES)


def ideal_seconds(case: Case) -> float:
    forward_s, backward_s, weight_s = costs(case)
    return pipeline.simulate(
        schedule_of(case), forward=forward_s, backward=backward_s, weight=weight_s
    ).makespan


def median_step_seconds(step: Callable[[], object], control: dist.ProcessGroup) -> float:
    """Median wall time of ``STEPS`` steps after ``WARMUP_STEPS``, each between barriers."""
    for _ in range(WARMUP_STEPS):
        step()
    times = []
    for _ in range(STEPS):
        dist.barrier(control)
        start = time.perf_counter()
        step()
        dist.barrier(control)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def this_rank_stages(case: Case, rank: int) -> list[tuple[int, SleepStage]]:
    """(stage index, module) for the stages rank ``rank`` holds (``rank, rank + p, ...``, or
    ``rank`` and ``2p - 1 - rank`` in zbv's V)."""
    indices = schedule_of(case).stages_of_rank(rank)
    return [(index, SleepStage(*costs(case), first=index == 0)) for index in indices]


def batch_arguments(case: Case, rank: int, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, dict]:
    """What this rank passes to ``step``: the batch on the first stage's rank, the target on
    the last stage's."""
    first, last = ends_on_rank(schedule_of(case), rank)
    return ((x,) if first else ()), ({"target": y} if last else {})


def torch_mp_pipeline(case: Case, group: dist.ProcessGroup) -> pipeline.Pipeline:
    modules = [module for _, module in this_rank_stages(case, dist.get_rank(group))]
    return pipeline.Pipeline(
        modules, schedule_of(case), loss_fn=nn.functional.mse_loss, group=group
    )


def time_torch_mp(
    case: Case, group: dist.ProcessGroup, control: dist.ProcessGroup, x, y
) -> tuple[float, float]:
    """Median step seconds for torch_mp, and the makespan ``simulate`` gives with the mean
    F, B, W and BW durations every rank's trace of its last step measured (the ideal for the
    stages as they really ran, sleeps' overshoot included: what is left above it is the
    library's own)."""
    pipe = torch_mp_pipeline(case, group)
    args, kwargs = batch_arguments(case, dist.get_rank(group), x, y)
    seconds = median_step_seconds(lambda: pipe.step(*args, **kwargs), control)
    durations = [(t.action.kind, t.end - t.start) for t in pipe.trace.timeline]
    everyone = [None] * NUM_RANKS
    dist.all_gather_object(everyone, durations, group=control)

    def mean(kind: str) -> float:
        values = [d for rank_durations in everyone for k, d in rank_durations if k == kind]
        return statistics.mean(values) if values else 0.0

    split = mean("B") > 0
    measured = pipeline.simulate(
        schedule_of(case),
        forward=mean("F"),
        backward=mean("B") if split else mean("BW"),
        weight=mean("W") if split else 0.0,
    ).makespan
    return seconds, measured


def time_torch_pipelining(
    case: Case, group: dist.ProcessGroup, control: dist.ProcessGroup, x, y
) -> float:
    """Median step seconds for torch.distributed.pipelining."""
    rank = dist.get_rank(group)
    num_stages = NUM_RANKS * case.stages_per_rank
    # Static shapes, so no inference step. The examples must require grad: a stage receives
    # no output gradient for an example output that does not (and then fails in backward).
    example = torch.zeros(MICROBATCH_SIZE, WIDTH, requires_grad=True)
    stages = [
        torch_pipelining.PipelineStage(
            module,
            index,
            num_stages,
            torch.device("cpu"),
            input_args=example,
            output_args=example,
            group=group,
        )
        for index, module in this_rank_stages(case, rank)
    ]
    single = issubclass(case.torch_class, torch_pipelining.schedules.PipelineScheduleSingle)
    schedule = case.torch_class(
        stages[0] if single else stages, NUM_MICROBATCHES, loss_fn=nn.functional.mse_loss
    )
    args, kwargs = batch_arguments(case, rank, x, y)
    return median_step_seconds(lambda: schedule.step(*args, **kwargs), control)


@dataclass(frozen=True)
class _Action:
    kind: str
    stage: int
    microbatch: int
    is_compute: bool


@dataclass(frozen=True)
class _TimedAction:
    rank: int
    action: _Action
    start: float
    end: float


@dataclass(frozen=True)
class _MeasuredTrace:
    """Every rank's measured actions, in the form ``pipeline.render`` reads."""

    timeline: list[_TimedAction]


def measured_trace(
    case: Case, group: dist.ProcessGroup, control: dist.ProcessGroup, x, y
) -> _MeasuredTrace | None:
    """Runs ``case`` with torch_mp and gathers every rank's trace of its last step to rank 0
    (None elsewhere), in units of ``FORWARD``, each rank shifted by when it entered ``step``."""
    pipe = torch_mp_pipeline(case, group)
    rank = dist.get_rank(group)
    args, kwargs = batch_arguments(case, rank, x, y)
    for _ in range(WARMUP_STEPS):
        pipe.step(*args, **kwargs)
    dist.barrier(control)
    entered = time.time()  # one clock for all processes of this machine
    pipe.step(*args, **kwargs)
    rows = [
        (t.rank, t.action.kind, t.action.stage, t.action.microbatch, t.action.is_compute)
        + (t.start, t.end)
        for t in pipe.trace.timeline
    ]
    gathered = [None] * NUM_RANKS if rank == 0 else None
    dist.gather_object((entered, rows), gathered, dst=0, group=control)
    if rank != 0:
        return None
    first = min(entered for entered, _ in gathered)
    timeline = []
    for entered, rows in gathered:
        shift = entered - first
        for rank_, kind, stage, microbatch, is_compute, start, end in rows:
            timeline.append(
                _TimedAction(
                    rank_,
                    _Action(kind, stage, microbatch, is_compute),
                    (shift + start) / FORWARD,
                    (shift + end) / FORWARD,
                )
            )
    return _MeasuredTrace(timeline)


def render_pictures(traces: dict[str, _MeasuredTrace]) -> list[str]:
    """Writes the simulated and measured timelines under docs/; returns their paths."""
    os.makedirs(DOCS, exist_ok=True)
    paths = []
    by_name = {case.name: case for case in CASES}
    for name in ("zb_h1", "1f1b"):
        # In units of one forward: the same picture as in seconds, at a readable width.
        result = pipeline.simulate(
            schedule_of(by_name[name]),
            forward=1.0,
            backward=BACKWARD / FORWARD,
            weight=WEIGHT / FORWARD,
        )
        path = os.path.join(DOCS, f"pipeline_{name}.png")
        pipeline.render(
            result,
            path,
            title=f"{name} simulated, p={NUM_RANKS}, m={NUM_MICROBATCHES}, F=B=W "
            f"(one unit = {FORWARD * 1e3:g} ms): bubble {result.bubble_fraction:.1%}",
        )
        paths.append(path)
    for name, trace in traces.items():
        path = os.path.join(DOCS, f"pipeline_measured_{name}.png")
        makespan = max(t.end for t in trace.timeline)
        pipeline.render(
            trace,
            path,
            title=f"{name} measured with torch_mp, p={NUM_RANKS}, m={NUM_MICROBATCHES} "
            f"(one unit = {FORWARD * 1e3:g} ms): step {makespan * FORWARD:.3f} s",
        )
        paths.append(path)
    return [os.path.relpath(p) for p in paths]


def main() -> int:
    mesh = torch_mp.init(pp=NUM_RANKS, backend="gloo", timeout=120)
    group = mesh.pp_group
    # The benchmark's own barriers and gathers go through a group of their own, so that they
    # never queue behind (or between) the libraries' messages.
    control = dist.new_group(backend="gloo")
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    x = torch.randn(NUM_MICROBATCHES * MICROBATCH_SIZE, WIDTH)
    y = torch.randn(NUM_MICROBATCHES * MICROBATCH_SIZE, WIDTH)

    rows = []
    for case in CASES:
        ideal = ideal_seconds(case)
        mine, as_run = time_torch_mp(case, group, control, x, y)
        theirs = time_torch_pipelining(case, group, control, x, y)
        rows.append((case, ideal, mine, as_run, theirs))
    traces = {
        case.name: measured_trace(case, group, control, x, y)
        for case in CASES
        if case.name in ("1f1b", "zb_h1")
    }

    if rank == 0:
        print(
            f"p={NUM_RANKS} ranks, m={NUM_MICROBATCHES} micro-batches of [{MICROBATCH_SIZE}, "
            f"{WIDTH}], stage sleeps F={FORWARD * 1e3:g} ms, B={BACKWARD * 1e3:g} ms, "
            f"W={WEIGHT * 1e3:g} ms per rank's share; median of {STEPS} steps after "
            f"{WARMUP_STEPS} warm-up; torch {torch.__version__}, Gloo, CPU"
        )
        print()
        print(
            "| schedule | ideal (s) | torch_mp step (s) | torch_mp / ideal "
            "| torch_mp / ideal as run | torch.distributed.pipelining (class) | its step (s) "
            "| its / ideal |"
        )
        print("|---|---:|---:|---:|---:|---|---:|---:|")
        for case, ideal, mine, as_run, theirs in rows:
            print(
                f"| {case.name} | {ideal:.3f} | {mine:.3f} | {mine / ideal:.2f} "
                f"| {mine / as_run:.2f} | {case.torch_class.__name__} | {theirs:.3f} "
                f"| {theirs / ideal:.2f} |"
            )
        print()
        print(
            "command: .venv/bin/torchrun --standalone --nproc-per-node=4 "
            "benchmarks/pipeline_overhead.py"
        )
        print("pictures:", ", ".join(render_pictures(traces)))
    dist.barrier(control)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
