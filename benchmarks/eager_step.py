"""Eager training-step time of torch_mp's layers: a tensor-parallel MLP, a transformer layer and
a pipeline step, on real layers (matmuls) over Gloo.

Run on CPU, 2 ranks (more processes than cores would hide what is measured)::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/eager_step.py --case tensor
    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/eager_step.py --case pipeline
    .venv/bin/torchrun --standalone --nproc-per-node=1 benchmarks/eager_step.py --case overhead

Every case is forward + backward (sum of squares, or the pipeline's loss) at tp = 2 (the
pipeline: pp = 2, two stages of transformer layers, 1F1B over 4 micro-batches). Each step runs
between barriers, so it times the slowest rank; the table gives the median of ``--steps`` after
``--warmup`` untimed steps. The small MLP is there for the per-call overhead of the front end
(its matmuls are tiny), the others for what a step costs on layers of some size. ``overhead``
isolates the front end: one rank (no communication), a tiny MLP and transformer layer, the mean
of 2000 steps.

To compare two builds side by side, run this script alternately against each (``PYTHONPATH``
pointing at the other build's package) and compare the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import torch_mp
from torch_mp import pipeline


def timed(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tensor_parallel_cases(args) -> list[tuple[str, float]]:
    torch_mp.init(tp=dist.get_world_size())
    rows = []
    for name, hidden, tokens in (
        ("MLP h=64, 32 tokens", 64, 32),
        ("MLP h=512, 512 tokens", 512, 512),
    ):
        torch.manual_seed(0)
        mlp = torch_mp.ParallelMLP(hidden, 4 * hidden)
        x = torch.randn(tokens, hidden, requires_grad=True)
        rows.append(
            (
                name,
                timed(
                    lambda mlp=mlp, x=x: mlp(x).square().sum().backward(), args.warmup, args.steps
                ),
            )
        )
    torch.manual_seed(0)
    layer = torch_mp.ParallelTransformerLayer(512, 8, 2048, dropout=0.0, norm_first=True)
    x = torch.randn(128, 4, 512, requires_grad=True)
    rows.append(
        (
            "transformer layer h=512, [128, 4]",
            timed(
                lambda: layer(x, is_causal=True).square().sum().backward(), args.warmup, args.steps
            ),
        )
    )
    return rows


def pipeline_case(args) -> list[tuple[str, float]]:
    mesh = torch_mp.init(pp=dist.get_world_size())
    torch.manual_seed(0)

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                torch_mp.ParallelTransformerLayer(256, 8, 1024, dropout=0.0, norm_first=True)
                for _ in range(2)
            )

        def forward(self, x):
            for layer in self.layers:
                x = layer(x, is_causal=True)
            return x

    pipe = pipeline.Pipeline(
        Stage(),
        "1f1b",
        num_microbatches=4,
        loss_fn=lambda y, target: (y - target).square().mean(),
        mesh=mesh,
    )
    # Micro-batches split the batch dim 0: [b, s, h] in, each stage's layers take [s, b, h].
    x = torch.randn(64, 8, 256)
    target = torch.randn(64, 8, 256)
    first, last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
    return [
        (
            "pipeline step, pp=2, 2 layers h=256 per stage, 4 micro-batches",
            timed(
                lambda: pipe.step(x if first else None, target=target if last else None),
                args.warmup,
                args.steps,
            ),
        )
    ]


def overhead_cases(args) -> list[tuple[str, float]]:
    torch_mp.init(tp=1)
    torch.manual_seed(0)
    mlp = torch_mp.ParallelMLP(16, 32)
    layer = torch_mp.ParallelTransformerLayer(16, 2, 32, dropout=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    tokens = torch.randn(4, 1, 16, requires_grad=True)
    rows = []
    for name, step in (
        ("tiny MLP, 1 rank (front-end cost), per step", lambda: mlp(x).sum().backward()),
        (
            "tiny transformer layer, 1 rank (front-end cost), per step",
            lambda: layer(tokens).sum().backward(),
        ),
    ):
        for _ in range(200):
            step()
        start = time.perf_counter()
        for _ in range(2000):
            step()
        rows.append((name, (time.perf_counter() - start) / 2000 * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--case", choices=["tensor", "pipeline", "overhead"], default="tensor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cases = {"tensor": tensor_parallel_cases, "pipeline": pipeline_case, "overhead": overhead_cases}
    rows = cases[args.case](args)
    if dist.get_rank() == 0:
        print(f"torch_mp from {torch_mp.__file__}")
        print("| case | eager step ms (median) |")
        print("|---|---|")
        for name, ms in rows:
            print(f"| {name} | {ms:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
