"""Peak activation memory per pipeline rank, measured, next to what ``pipeline.simulate``
predicts, for every schedule.

Run on CPU with Gloo (2 ranks)::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/pipeline_memory.py

Each stage is 4 x (``nn.Linear(W, W)`` + GELU); m micro-batches of ``rows`` rows. Memory is
counted at the dispatcher (``torch_mp._memory.PeakMemory``, which works on the CPU): the most
tensor storage allocated during one ``Pipeline.step`` and alive at once, parameters and the
batch excluded (they exist before the step), gradients of the parameters included (they are
allocated by the first backward and stay).

The prediction: ``simulate`` tells how many micro-batches a rank holds at most
(``peak_live_microbatches``: forwards done whose backward has not run); one micro-batch's
activations are measured once, as what one forward keeps alive for its backward. The predicted
peak is that count times one micro-batch's activations, plus the parameter gradients. A
micro-batch between its B and its W (zero-bubble) still holds what its W needs, which
``simulate`` does not count; the measured column shows what that costs.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import torch_mp
from torch_mp import pipeline
from torch_mp._memory import PeakMemory

NUM_RANKS = 2
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
    ("interleaved_zb", 2),
    ("zbv", 2),
]


def stage_module(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])


def activation_bytes(module: nn.Module, rows: int, width: int) -> int:
    """What one micro-batch's forward keeps alive for its backward (the graph's saved tensors
    and the output)."""
    x = torch.randn(rows, width, requires_grad=True)
    with PeakMemory() as meter:
        out = module(x)
        kept = meter.current
    del out
    return kept


def measure(name: str, per_rank: int, args: argparse.Namespace, mesh) -> tuple[int, int, int]:
    """(measured peak bytes, predicted bytes, peak live micro-batches) on this rank."""
    rank = mesh.pp_rank
    torch.manual_seed(0)
    layers = args.layers // per_rank
    modules = [stage_module(args.width, layers) for _ in range(NUM_RANKS * per_rank)]
    schedule = pipeline.schedule(name, NUM_RANKS * per_rank, args.microbatches, per_rank)
    mine = [modules[i] for i in schedule.stages_of_rank(rank)]
    pipe = pipeline.Pipeline(mine, schedule, loss_fn=nn.functional.mse_loss, mesh=mesh)
    batch = torch.randn(args.microbatches * args.rows, args.width)
    first = schedule.rank_of_stage(0) == rank
    last = schedule.rank_of_stage(schedule.num_stages - 1) == rank
    step_args = (batch,) if first else ()
    kwargs = {"target": batch} if last else {}
    pipe.step(*step_args, **kwargs)  # warm-up: the gradients exist from now on
    for module in mine:
        module.zero_grad(set_to_none=True)
    with PeakMemory() as meter:
        pipe.step(*step_args, **kwargs)
    live = pipeline.simulate(schedule).peak_live_microbatches[rank]
    per_microbatch = activation_bytes(mine[0], args.rows, args.width)
    grads = sum(p.numel() * p.element_size() for m in mine for p in m.parameters())
    return meter.peak, live * per_microbatch + grads, live


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="per rank")
    parser.add_argument("--rows", type=int, default=64, help="per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = torch_mp.init(pp=NUM_RANKS, backend="gloo", timeout=120)
    rows = []
    for name, per_rank in SCHEDULES:
        peak, predicted, live = measure(name, per_rank, args, mesh)
        everyone = [None] * NUM_RANKS
        dist.all_gather_object(everyone, (peak, predicted, live))
        rows.append((name, everyone))
    if dist.get_rank() == 0:
        mib = 1 << 20
        print(
            f"p={NUM_RANKS}, m={args.microbatches} micro-batches of [{args.rows}, {args.width}], "
            f"{args.layers} x (Linear + GELU) per rank, fp32; peak tensor memory in one step "
            f"(MiB), parameter gradients included"
        )
        print()
        print("| schedule | rank | peak live micro-batches (simulate) | predicted | measured |")
        print("|---|---:|---:|---:|---:|")
        for name, everyone in rows:
            for rank, (peak, predicted, live) in enumerate(everyone):
                print(f"| {name} | {rank} | {live} | {predicted / mib:.1f} | {peak / mib:.1f} |")
        print()
        print(
            "command: .venv/bin/torchrun --standalone --nproc-per-node=2 "
            "benchmarks/pipeline_memory.py"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
