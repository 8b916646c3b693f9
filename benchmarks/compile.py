"""Training step time of tensor-parallel modules: torch.compile against eager.

Run on CPU with Gloo (2 ranks)::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/compile.py

One step is forward + backward (sum of squares) of ``--layers`` ``ParallelTransformerLayer``s
(hidden ``--hidden``, 8 heads, ffn 4x, pre-LN, no dropout) on ``[--seq, --batch, hidden]``
inputs, tensor parallel (and, in the second row, sequence parallel). Eager runs the C++ core's
fused paths; compiled is ``torch.compile(model, fullgraph=True)`` (inductor), which traces the
same mathematics through the core's collectives registered as operators (torch_mp/ops.py). Each
side runs ``--warmup`` untimed steps (compilation included there), then the timed steps alternate
between the two; each step runs between barriers, so it measures the slowest rank. Median.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import torch_mp


def model(args, sequence_parallel: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [
        torch_mp.ParallelTransformerLayer(
            args.hidden,
            8,
            4 * args.hidden,
            dropout=0.0,
            norm_first=True,
            sequence_parallel=sequence_parallel,
        )
        for _ in range(args.layers)
    ]
    return nn.Sequential(*layers)


def step(module: nn.Module, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    module(x).square().sum().backward()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = torch_mp.init(tp=dist.get_world_size())
    rows = []
    for sequence_parallel in (False, True):
        eager = model(args, sequence_parallel)
        compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
        seq = args.seq // mesh.tp_size if sequence_parallel else args.seq
        x = torch.randn(seq, args.batch, args.hidden)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.warmup):
            step(eager, x)
            step(compiled, x)
        for i in range(args.steps):
            order = ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")
            for name in order:
                times[name].append(step(eager if name == "eager" else compiled, x))
        e, c = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
        rows.append((("tensor + sequence" if sequence_parallel else "tensor"), e, c))
    if dist.get_rank() == 0:
        print(
            f"{args.layers} x ParallelTransformerLayer({args.hidden}, 8 heads, ffn "
            f"{4 * args.hidden}), [s={args.seq}, b={args.batch}], tp = {mesh.tp_size}, fp32, "
            f"forward + backward, median of {args.steps}"
        )
        print("| parallelism | eager ms | torch.compile ms | compiled / eager |")
        print("|---|---|---|---|")
        for name, e, c in rows:
            print(f"| {name} | {e:.1f} | {c:.1f} | {c / e:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
