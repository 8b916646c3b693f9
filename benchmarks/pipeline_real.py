"""Pipeline step time on real layers: torch_mp beside torch.distributed.pipelining, for the same
schedules, stages, weights and micro-batches, at p = 2 pipeline ranks on CPU with Gloo.

Run (two ranks, one thread each, so two cores are enough; the two variables keep glibc from
handing large freed blocks back to the system, see split_backward.py)::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \
        .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/pipeline_real.py

Unlike ``pipeline_overhead.py``, whose stages sleep, here the stages compute (matmuls), so what
is measured is what a user sees: compute, the library's bookkeeping, Gloo point-to-point and
the pipeline bubble together. The models (each rank holds the same share of the model in every
schedule; with interleaved_1f1b, interleaved_zb and zbv, 2 stages per rank, there are 4 stages
of half the layers):

- ``linear W``: each of the 2 stages is 4 x (``nn.Linear(W, W)`` + ``nn.GELU()``), W = 512 and
  W = 1024; micro-batches of 32 rows, m = 8, fp32;
- ``transformer``: each of the 2 stages is 2 x ``torch_mp.ParallelTransformerLayer`` (hidden
  256, 4 heads, ffn 1024, gelu, no dropout) at tensor-parallel size 1; the stages take
  ``[b, s, h]`` (both libraries split micro-batches along dim 0) and transpose to the layers'
  ``[s, b, h]`` and back; micro-batches of 4 sequences of 64, m = 8.

Every library gets its own deep copies of modules built from one seed (the same initial
weights), the same batch and an mse loss against a random target. For each model and schedule,
and each library: ``--warmup`` steps, then ``--steps`` steps, each between two barriers of a
``control`` Gloo group of the benchmark's own; the table shows the median. "ideal" is the
median time of forward + backward of the whole model on the whole batch in one process (rank 0,
no communication, the same numbers of steps) divided by p: perfect pipelining without bubble or
overhead, and without the cost of micro-batching itself (on one CPU thread, 8 micro-batches of 32
rows through the linear 512 stack take about 2.5 times one batch of 256), so no schedule reaches
it. torch.distributed.pipelining has no ZB-H1 class: its ``ScheduleInterleavedZeroBubble``
with one stage per rank is the ZB1P (= ZB-H1) schedule, so the zb_h1 rows compare against that;
with two stages per rank it is the interleaved zero-bubble schedule. zbv (two stages per rank
in a V) runs against ``ScheduleZBVZeroBubble``.

The second table reads torch_mp's own traces of its timed steps on rank 1 (the last stage,
which computes input gradients): the mean durations of F and BW (from the 1f1b run) and of B and
W (from the zb_h1 run), how much a split backward costs over a fused one ((B + W) / BW), and the
zb_h1 / 1f1b step-time ratio of each library next to the theory: ``pipeline.simulate`` of zb_h1
with the measured F, B, W over that of 1f1b with F and a backward of B + W.
"""

from __future__ import annotations

import argparse
import copy
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

NUM_RANKS = 2
NUM_MICROBATCHES = 8
LINEAR_WIDTHS = (512, 1024)
LINEAR_LAYERS_PER_RANK = 4
LINEAR_MICROBATCH = 32  # rows
TRANSFORMER_LAYERS_PER_RANK = 2
HIDDEN, HEADS, FFN, SEQ = 256, 4, 1024, 64
TRANSFORMER_MICROBATCH = 4  # sequences
COMMAND = (
    "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 "
    ".venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/pipeline_real.py"
)


class _SwapBatchAndSequence(torch.autograd.Function):
    """``x.transpose(0, 1)``, contiguous forward and backward.

    Gloo sends only contiguous tensors, and the input gradient of a plain transpose is itself a
    transposed view: torch.distributed.pipelining sends the stage's input gradient as autograd
    returns it, which fails with a split backward (``ScheduleInterleavedZeroBubble``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.transpose(0, 1).contiguous()


class TransformerStage(nn.Module):
    """Transformer layers on ``[b, s, h]``: the layers take ``[s, b, h]``, the pipelines split
    micro-batches along dim 0, so the stage transposes in and out (copying, see
    ``_SwapBatchAndSequence``)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _SwapBatchAndSequence.apply(x)
        for layer in self.layers:
            x = layer(x)
        return _SwapBatchAndSequence.apply(x)


@dataclass
class Model:
    """A model as a list of layers, cut into stages the same way for every library."""

    name: str
    layers: list[nn.Module]  # the blocks one stage holds a whole number of
    stage: Callable[[list[nn.Module]], nn.Module]  # builds a stage from its blocks
    x: torch.Tensor  # the whole batch, [NUM_MICROBATCHES * micro-batch, ...]
    y: torch.Tensor  # its target

    def stages(self, num_stages: int) -> list[nn.Module]:
        """Fresh deep copies of the model cut into ``num_stages`` equal stages."""
        per_stage = len(self.layers) // num_stages
        return [
            self.stage([copy.deepcopy(b) for b in self.layers[i * per_stage : (i + 1) * per_stage]])
            for i in range(num_stages)
        ]

    def whole(self) -> nn.Module:
        """A deep copy of the whole model in one module (cut as the 1-stage-per-rank pipeline)."""
        return nn.Sequential(*self.stages(NUM_RANKS))


def linear_model(width: int, microbatch: int, layers_per_rank: int, seed: int) -> Model:
    torch.manual_seed(seed)
    layers = [
        nn.Sequential(nn.Linear(width, width), nn.GELU())
        for _ in range(NUM_RANKS * layers_per_rank)
    ]
    batch = NUM_MICROBATCHES * microbatch
    return Model(
        f"linear {width}",
        layers,
        lambda blocks: nn.Sequential(*blocks),
        torch.randn(batch, width),
        torch.randn(batch, width),
    )


def transformer_model(
    hidden: int, heads: int, ffn: int, seq: int, microbatch: int, layers_per_rank: int, seed: int
) -> Model:
    torch.manual_seed(seed)
    layers = [
        torch_mp.ParallelTransformerLayer(hidden, heads, ffn, dropout=0.0, activation="gelu")
        for _ in range(NUM_RANKS * layers_per_rank)
    ]
    batch = NUM_MICROBATCHES * microbatch
    return Model(
        "transformer",
        layers,
        TransformerStage,
        torch.randn(batch, seq, hidden),
        torch.randn(batch, seq, hidden),
    )


def median_step_seconds(
    step: Callable[[], object],
    control: dist.ProcessGroup,
    steps: int,
    warmup: int,
    after: Callable[[], None] = lambda: None,
) -> float:
    """Median wall time of ``steps`` steps after ``warmup``, each between barriers; ``after``
    runs after each timed step, untimed."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier(control)
        start = time.perf_counter()
        step()
        dist.barrier(control)
        times.append(time.perf_counter() - start)
        after()
    return statistics.median(times)


def ideal_seconds(model: Model, steps: int, warmup: int) -> float:
    """Median forward + backward of the whole model on the whole batch, in this process, over
    p."""
    whole = model.whole()

    def step() -> None:
        nn.functional.mse_loss(whole(model.x), model.y).backward()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / NUM_RANKS


def this_rank_stages(model: Model, case: Case, rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, fresh module) for the stages rank ``rank`` holds (``rank, rank + p, ...``,
    or ``rank`` and ``2p - 1 - rank`` in zbv's V)."""
    modules = model.stages(NUM_RANKS * case.stages_per_rank)
    indices = case.schedule(NUM_RANKS, NUM_MICROBATCHES).stages_of_rank(rank)
    return [(i, modules[i]) for i in indices]


def batch_arguments(case: Case, rank: int, model: Model) -> tuple[tuple, dict]:
    """What this rank passes to ``step``: the batch on the first stage's rank, the target on
    the last stage's."""
    first, last = ends_on_rank(case.schedule(NUM_RANKS, NUM_MICROBATCHES), rank)
    return ((model.x,) if first else ()), ({"target": model.y} if last else {})


def time_torch_mp(
    model: Model, case: Case, group, control, steps: int, warmup: int
) -> tuple[float, list[tuple[str, float]]]:
    """Median step seconds for torch_mp, and this rank's (kind, seconds) of every action of
    the timed steps, from its trace."""
    rank = dist.get_rank(group)
    modules = [module for _, module in this_rank_stages(model, case, rank)]
    pipe = pipeline.Pipeline(
        modules,
        case.schedule(NUM_RANKS, NUM_MICROBATCHES),
        loss_fn=nn.functional.mse_loss,
        group=group,
    )
    args, kwargs = batch_arguments(case, rank, model)
    durations = []

    def record() -> None:
        durations.extend((t.action.kind, t.end - t.start) for t in pipe.trace.timeline)

    seconds = median_step_seconds(
        lambda: pipe.step(*args, **kwargs), control, steps, warmup, after=record
    )
    return seconds, durations


def time_torch_pipelining(
    model: Model, case: Case, group, control, steps: int, warmup: int
) -> float:
    """Median step seconds for torch.distributed.pipelining."""
    rank = dist.get_rank(group)
    num_stages = NUM_RANKS * case.stages_per_rank
    # Static shapes, so no inference step. The examples must require grad: a stage receives
    # no output gradient for an example output that does not (and then fails in backward).
    example = torch.zeros(model.x.shape[0] // NUM_MICROBATCHES, *model.x.shape[1:])
    example.requires_grad_()
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
        for index, module in this_rank_stages(model, case, rank)
    ]
    single = issubclass(case.torch_class, torch_pipelining.schedules.PipelineScheduleSingle)
    schedule = case.torch_class(
        stages[0] if single else stages, NUM_MICROBATCHES, loss_fn=nn.functional.mse_loss
    )
    args, kwargs = batch_arguments(case, rank, model)
    return median_step_seconds(lambda: schedule.step(*args, **kwargs), control, steps, warmup)


def mean_ms(durations: list[tuple[str, float]], kind: str) -> float:
    values = [seconds for k, seconds in durations if k == kind]
    return 1e3 * statistics.mean(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models, to check that everything runs"
    )
    options = parser.parse_args()
    torch.set_num_threads(1)

    mesh = torch_mp.init(pp=NUM_RANKS, backend="gloo", timeout=120)
    group = mesh.pp_group
    # The benchmark's own barriers and gathers go through a group of their own, so that they
    # never queue behind (or between) the libraries' messages.
    control = dist.new_group(backend="gloo")
    rank = dist.get_rank(group)
    steps, warmup = options.steps, options.warmup

    if options.tiny:
        models = [
            linear_model(32, 4, 2, seed=0),
            transformer_model(32, 2, 64, 8, 2, 2, seed=1),
        ]
    else:
        models = [
            linear_model(width, LINEAR_MICROBATCH, LINEAR_LAYERS_PER_RANK, seed=i)
            for i, width in enumerate(LINEAR_WIDTHS)
        ]
        models.append(
            transformer_model(
                HIDDEN,
                HEADS,
                FFN,
                SEQ,
                TRANSFORMER_MICROBATCH,
                TRANSFORMER_LAYERS_PER_RANK,
                seed=len(models),
            )
        )

    rows = []  # (model, case, ideal, torch_mp, torch.pipelining)
    traces = {}  # (model name, case name) -> rank 1's (kind, seconds)
    for model in models:
        ideal = ideal_seconds(model, steps, warmup) if rank == 0 else float("nan")
        dist.barrier(control)
        for case in CASES:
            mine, durations = time_torch_mp(model, case, group, control, steps, warmup)
            theirs = time_torch_pipelining(model, case, group, control, steps, warmup)
            rows.append((model, case, ideal, mine, theirs))
            if case.name in ("1f1b", "zb_h1"):
                gathered = [None] * NUM_RANKS if rank == 0 else None
                dist.gather_object(durations, gathered, dst=0, group=control)
                if rank == 0:
                    traces[model.name, case.name] = gathered[NUM_RANKS - 1]

    if rank == 0:
        print(
            f"p={NUM_RANKS} ranks, m={NUM_MICROBATCHES} micro-batches, fp32, median of {steps} "
            f"steps after {warmup} warm-up, 1 thread per rank; torch {torch.__version__}, Gloo, "
            "CPU"
        )
        print()
        print(
            "| model | schedule | torch.distributed.pipelining (class) | ideal (ms) "
            "| torch_mp (ms) | torch.pipelining (ms) | torch_mp / torch.pipelining "
            "| torch_mp / ideal | torch.pipelining / ideal |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for model, case, ideal, mine, theirs in rows:
            print(
                f"| {model.name} | {case.name} | {case.torch_class.__name__} "
                f"| {1e3 * ideal:.1f} | {1e3 * mine:.1f} | {1e3 * theirs:.1f} "
                f"| {mine / theirs:.2f} | {mine / ideal:.2f} | {theirs / ideal:.2f} |"
            )
        print()
        print(
            f"torch_mp's traces of its timed steps on rank {NUM_RANKS - 1} (the last stage): "
            "mean durations; theory = simulate(zb_h1, F, B, W) / simulate(1f1b, F, B + W):"
        )
        print()
        print(
            "| model | F (ms) | BW, 1f1b (ms) | B, zb_h1 (ms) | W, zb_h1 (ms) | (B + W) / BW "
            "| zb_h1 / 1f1b torch_mp | zb_h1 / 1f1b torch.pipelining | zb_h1 / 1f1b theory |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        steps_by = {(m.name, c.name): (mine, theirs) for m, c, _, mine, theirs in rows}
        for model in models:
            one_f_one_b, zero_bubble = traces[model.name, "1f1b"], traces[model.name, "zb_h1"]
            forward = mean_ms(one_f_one_b, "F")
            full_backward = mean_ms(one_f_one_b, "BW")
            backward, weight = mean_ms(zero_bubble, "B"), mean_ms(zero_bubble, "W")
            theory = (
                pipeline.simulate(
                    pipeline.schedule("zb_h1", NUM_RANKS, NUM_MICROBATCHES),
                    forward=forward,
                    backward=backward,
                    weight=weight,
                ).makespan
                / pipeline.simulate(
                    pipeline.schedule("1f1b", NUM_RANKS, NUM_MICROBATCHES),
                    forward=forward,
                    backward=backward + weight,
                ).makespan
            )
            mine_1f1b, theirs_1f1b = steps_by[model.name, "1f1b"]
            mine_zb, theirs_zb = steps_by[model.name, "zb_h1"]
            print(
                f"| {model.name} | {forward:.2f} | {full_backward:.2f} | {backward:.2f} "
                f"| {weight:.2f} | {(backward + weight) / full_backward:.2f} "
                f"| {mine_zb / mine_1f1b:.2f} | {theirs_zb / theirs_1f1b:.2f} | {theory:.2f} |"
            )
        print()
        print("command:", " ".join([COMMAND, *sys.argv[1:]]))
    dist.barrier(control)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
