"""What the zero-bubble split costs: B (input gradients) + W (weight gradients) against one
fused backward, on real layers, in one process.

Run (one process, one thread), with glibc told to keep the memory it frees::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \
        .venv/bin/torchrun --standalone --nproc-per-node=1 benchmarks/split_backward.py

Without those two variables glibc gives large freed blocks (a Linear(1024)'s 4 MiB weight
gradient) back to the system and page-faults them in again at the next allocation. The fused
backward frees and reallocates each such block while it is still mapped; B and W allocate them
in another order and pay the faults: (B + W) / BW reads 1.16-1.20 instead of 0.96-1.07 on the
Linear stacks and the conv block. That is the CPU allocator, not the split; a GPU's caching
allocator (and jemalloc or tcmalloc on a CPU) keeps freed blocks too.

For each model, the same forward is followed either by one backward (``torch.autograd.backward``
from the output to the input and every parameter) or by :func:`torch_mp.pipeline.backward_input`
then :func:`torch_mp.pipeline.backward_weight`, the two alternating, ``--steps`` times each after
``--warmup``; the table shows medians. The stage input is a leaf that requires grad (as in every
stage but the first) and parameter gradients exist already (as from the second micro-batch on),
so both variants accumulate. The models (what pipeline_real.py uses, plus a conv block):

- ``linear W``: 4 x (``nn.Linear(W, W)`` + GELU) on 32 rows, W = 512 and 1024;
- ``transformer``: 2 x ``torch_mp.ParallelTransformerLayer(256, 4, 1024)`` at tp = 1, on
  ``[64, 4, 256]``;
- ``conv block``: ``torch_mp.ParallelConvBlock(32, 64, 32)`` at tp = 1 on ``[8, 32, 32, 32]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import torch_mp
from torch_mp import pipeline

COMMAND = ".venv/bin/torchrun --standalone --nproc-per-node=1 benchmarks/split_backward.py"


def models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    out = []
    for width in (512, 1024):
        stack = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.GELU())])
        out.append((f"linear {width}", stack, torch.randn(32, width)))
    layers = nn.Sequential(
        *[
            torch_mp.ParallelTransformerLayer(256, 4, 1024, dropout=0.0, activation="gelu")
            for _ in range(2)
        ]
    )
    out.append(("transformer", layers, torch.randn(64, 4, 256)))
    out.append(("conv block", torch_mp.ParallelConvBlock(32, 64, 32), torch.randn(8, 32, 32, 32)))
    return out


def measure(module: nn.Module, x: torch.Tensor, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds of the fused backward, B and W."""
    parameters = list(module.parameters())
    grad = torch.randn_like(module(x))
    times: dict[str, list[float]] = {"BW": [], "B": [], "W": []}

    def timed(kind: str, fn: Callable[[], object], record: bool):
        start = time.perf_counter()
        result = fn()
        if record:
            times[kind].append(time.perf_counter() - start)
        return result

    def fused(out: torch.Tensor) -> None:
        torch.autograd.backward([out], [grad])

    def backward_input(out: torch.Tensor, leaf: torch.Tensor) -> pipeline.WeightWork:
        return pipeline.backward_input([out], [grad], [leaf], parameters)[1]

    for i in range(warmup + steps):
        record = i >= warmup
        leaf = x.clone().requires_grad_()
        timed("BW", functools.partial(fused, module(leaf)), record)
        leaf = x.clone().requires_grad_()
        work = timed("B", functools.partial(backward_input, module(leaf), leaf), record)
        timed("W", functools.partial(pipeline.backward_weight, work), record)
    return {kind: statistics.median(values) for kind, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(1)
    torch_mp.init(backend="gloo")
    print(
        f"one process, 1 thread, fp32, median of {options.steps} after {options.warmup} warm-up; "
        f"torch {torch.__version__}, CPU"
    )
    print()
    print("| model | BW (ms) | B (ms) | W (ms) | (B + W) / BW |")
    print("|---|---:|---:|---:|---:|")
    for name, module, x in models():
        t = measure(module, x, options.steps, options.warmup)
        print(
            f"| {name} | {1e3 * t['BW']:.2f} | {1e3 * t['B']:.2f} | {1e3 * t['W']:.2f} "
            f"| {(t['B'] + t['W']) / t['BW']:.2f} |"
        )
    print()
    print("command:", " ".join([COMMAND, *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
