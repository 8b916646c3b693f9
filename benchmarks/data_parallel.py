"""Data-parallel training step time: torch_mp.DataParallel beside PyTorch's DDP and no sync.

Run on CPU with Gloo (2 ranks)::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/data_parallel.py

One training step is forward + backward (mean-squared error against a random target) + an SGD
step, of an MLP of ``--layers`` x (``nn.Linear(width, width)`` + GELU) in fp32, on a batch of
``--batch`` rows per rank (each rank draws its own data, seeded by its rank). The same model
(one set of initial weights, deep-copied) is wrapped in:

- ``DistributedDataParallel(model, process_group=mesh.dp_group)``;
- ``torch_mp.DataParallel(model, mesh=mesh)``, and the same with ``comm_hook="bf16"``;
- nothing: the plain model, no gradient sync (each rank trains alone), the lower bound.

The defaults (8 x 1024 x 1024, about 8.4M parameters, 32 MiB of fp32 gradients) fill several
25 MiB buckets. Before timing, one step of DDP and of ``torch_mp.DataParallel`` must give the
same averaged gradients (``torch.allclose``, rtol 1e-5), or the benchmark raises.

Each wrapper runs ``--warmup`` untimed steps, then the timed steps go round-robin over the
wrappers (the starting wrapper rotating each round) so that drift in the machine's speed touches
all of them alike. Each timed step runs between two barriers on a group of the benchmark's own,
so it measures the slowest rank; the table shows the median. Thread count is 1 per rank.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_mp

LEARNING_RATE = 1e-3
MIB = 2**20


@dataclass
class Runner:
    """One wrapped copy of the model, its optimizer and its measured step times."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        nn.functional.mse_loss(self.model(x), target).backward()
        self.optimizer.step()


def make_model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def make_runners(model: nn.Module, mesh: torch_mp.Mesh, bf16: bool) -> list[Runner]:
    """Each wrapper around its own deep copy of ``model``."""
    wrapped: dict[str, Callable[[nn.Module], nn.Module]] = {
        "DistributedDataParallel": lambda m: DistributedDataParallel(
            m, process_group=mesh.dp_group
        ),
        "torch_mp.DataParallel": lambda m: torch_mp.DataParallel(m, mesh=mesh),
        "no sync (plain model)": lambda m: m,
    }
    if bf16:
        wrapped['torch_mp.DataParallel, comm_hook="bf16"'] = lambda m: torch_mp.DataParallel(
            m, mesh=mesh, comm_hook="bf16"
        )
    runners = []
    for name, wrap in wrapped.items():
        module = wrap(copy.deepcopy(model))
        optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
        runners.append(Runner(name, module, optimizer))
    return runners


def check_same_gradients(ddp: Runner, ours: Runner, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of each; raises unless their averaged gradients agree."""
    ddp.step(x, y)
    ours.step(x, y)
    pairs = zip(ddp.model.module.parameters(), ours.model.module.parameters(), strict=True)
    for index, (theirs, mine) in enumerate(pairs):
        if not torch.allclose(mine.grad, theirs.grad, rtol=1e-5, atol=0.0):
            error = (mine.grad - theirs.grad).abs().max().item()
            raise RuntimeError(
                f"rank {dist.get_rank()}: parameter {index}: torch_mp.DataParallel's gradient "
                f"differs from DDP's (max abs difference {error:.3g})"
            )


def timed_step(runner: Runner, x, y, control: dist.ProcessGroup) -> None:
    dist.barrier(control)
    start = time.perf_counter()
    runner.step(x, y)
    dist.barrier(control)
    runner.times.append(time.perf_counter() - start)


def run(runners: list[Runner], x, y, steps: int, warmup: int, control) -> None:
    """``warmup`` steps of each, then ``steps`` timed steps of each, round-robin."""
    for runner in runners:
        for _ in range(warmup):
            runner.step(x, y)
    for round_ in range(steps):
        shift = round_ % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            timed_step(runner, x, y, control)


def command(world: int) -> str:
    return f".venv/bin/torchrun --standalone --nproc-per-node={world} " + " ".join(
        ["benchmarks/data_parallel.py", *sys.argv[1:]]
    )


def print_table(runners: list[Runner], model: nn.Module, args, world: int) -> None:
    parameters = sum(p.numel() for p in model.parameters())
    gradient_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    print(
        f"MLP {args.layers} x Linear({args.width}, {args.width}) + GELU: {parameters / 1e6:.2f}M "
        f"parameters, {gradient_mib:.1f} MiB of fp32 gradients; {world} ranks, batch "
        f"{args.batch} per rank; median of {args.steps} steps after {args.warmup} warm-up; "
        f"torch {torch.__version__}, Gloo, CPU, 1 thread per rank"
    )
    print()
    print("| wrapper | step time (ms, median) | ratio to DDP | sync overhead vs no sync (ms) |")
    print("|---|---:|---:|---:|")
    medians = {r.name: statistics.median(r.times) * 1e3 for r in runners}
    ddp, none = medians["DistributedDataParallel"], medians["no sync (plain model)"]
    for name, ms in medians.items():
        print(f"| {name} | {ms:.1f} | {ms / ddp:.2f} | {ms - none:+.1f} |")
    print()
    print(f"command: {command(world)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per wrapper")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per wrapper")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 comm_hook row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = torch_mp.init(backend="gloo", timeout=60)
    # The benchmark's barriers go through a group of their own, never between the wrappers'
    # all-reduces.
    control = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = make_model(args.layers, args.width)
    runners = make_runners(model, mesh, bf16=not args.no_bf16)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randn(args.batch, args.width, generator=generator)

    check_same_gradients(runners[0], runners[1], x, y)
    run(runners, x, y, args.steps, args.warmup, control)
    if rank == 0:
        print_table(runners, model, args, world)
    dist.barrier(control)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
