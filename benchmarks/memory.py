"""Memory per data-parallel rank: DDP + AdamW, torch's ZeroRedundancyOptimizer, FSDP2's
``fully_shard`` (resharding after forward, and not), and torch_mp's DistributedOptimizer
(ZeRO-1), with sharded gradients (ZeRO-2), each with its all-gather overlapped with the next
forward too, with sharded parameters (ZeRO-3, each Linear a unit as each is FSDP2's), and bf16
with fp32 main gradients and masters; with the step time of each. Then activation
memory of a transformer layer with and without recomputation.

Run on CPU with Gloo, once per data-parallel size::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/memory.py
    .venv/bin/torchrun --standalone --nproc-per-node=4 benchmarks/memory.py

The model is ``--layers`` x ``nn.Linear(width, width)`` + GELU (the defaults: 12 x 2048 x 2048,
50M parameters, 201 MB in fp32), trained with AdamW on ``--batch`` rows per rank. Each setup is
built from scratch inside torch_mp's dispatcher-level counter (``torch_mp._memory.PeakMemory``,
which sees every tensor the C++ core and c10d allocate on the calling thread), trained for
``--steps`` steps, and reported as:

- parameters, and optimizer state (what the optimizer's state holds on this rank: the local
  optimizer's for the sharded ones, fp32 masters included), from the tensors themselves;
- gradients and buffers: everything else alive when the optimizer steps (``.grad``, DDP's
  buckets, the sharded gradients, fp32 main gradients), and the total of the three then;
- the peak during a step, and the median step time (the slowest rank's, between barriers).

Then the step times again, with every setup built at once and stepped in turn, round after round
(``--rounds``; in its turn each setup takes two steps, the second timed): the ratios to DDP and
to ZeroRedundancyOptimizer from that table are measured side by side, on the same machine at
the same moments.

Beside the measured total, the formula for it in units of Psi (the model's parameters), with
Adam's 8 bytes of moments per fp32 parameter and N data ranks. Every rank of one machine shares
its two cores: the step times compare the setups with one another, not with a real cluster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp._memory import PeakMemory

MB = 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one untimed)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated words: run only the setups whose names contain one (DDP + AdamW "
        "and ZeroRedundancyOptimizer always run: the ratios are to them), e.g. --only ZeRO-2",
    )
    parser.add_argument("--seq", type=int, default=256, help="of the activation benchmark")
    parser.add_argument("--hidden", type=int, default=512, help="of the activation benchmark")
    parser.add_argument("--heads", type=int, default=8, help="of the activation benchmark")
    parser.add_argument(
        "--rounds", type=int, default=8, help="of the alternating step times (0: none)"
    )
    parser.add_argument(
        "--activations-only", action="store_true", help="only the activation benchmark"
    )
    return parser.parse_args()


def model_of(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*layers)


def state_bytes(state: dict) -> int:
    total, seen = 0, set()
    for per_param in state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                key = local.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += local.untyped_storage().nbytes()
    return total


def masters_bytes(optimizer) -> int:
    """The fp32 master shards of a DistributedOptimizer (they are its local optimizer's
    parameters, and not the model's)."""
    if not isinstance(optimizer, torch_mp.DistributedOptimizer):
        return 0
    model = {p.untyped_storage().data_ptr() for g in optimizer.param_groups for p in g["params"]}
    return sum(
        s.untyped_storage().nbytes()
        for g in optimizer.local_optimizer.param_groups
        for s in g["params"]
        if s.untyped_storage().data_ptr() not in model
    )


def setups(mesh, args) -> dict[str, Callable]:
    group = mesh.dp_group

    def ddp():
        model = model_of(args)
        wrapped = DistributedDataParallel(model, process_group=group)
        return wrapped, model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.float32

    def zero_redundancy():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = model_of(args)
        wrapped = DistributedDataParallel(model, process_group=group)
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-4
        )
        return wrapped, model, optimizer, torch.float32

    def fsdp2(reshard: bool = True):
        def build():
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            model = model_of(args)
            dp_mesh = DeviceMesh.from_group(group, "cpu")
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
            return model, model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.float32

        return build

    def zero(stage: int, overlap: bool = False):
        def build():
            model = model_of(args)
            wrapped = torch_mp.DataParallel(  # (ZeRO-3's units: each Linear, as FSDP2's)
                model, mesh=mesh, shard_gradients=stage == 2, shard_parameters=stage == 3
            )
            optimizer = torch_mp.DistributedOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                mesh=mesh,
                lr=1e-4,
                overlap_param_gather=overlap,
            )
            return wrapped, model, optimizer, torch.float32

        return build

    def bf16():
        model = model_of(args).to(torch.bfloat16)
        wrapped = torch_mp.DataParallel(model, mesh=mesh, grad_dtype=torch.float32)
        optimizer = torch_mp.DistributedOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            mesh=mesh,
            master_dtype=torch.float32,
            lr=1e-4,
        )
        return wrapped, model, optimizer, torch.bfloat16

    everything = {
        "DDP + AdamW": (ddp, lambda n: 16),  # (and DDP's buckets, a second copy of the grads)
        "DDP + ZeroRedundancyOptimizer": (zero_redundancy, lambda n: 8 + 8 / n),
        "FSDP2 fully_shard": (fsdp2(), lambda n: 16 / n),
        "FSDP2 fully_shard, no resharding": (fsdp2(False), lambda n: 16 / n),
        "torch_mp ZeRO-1": (zero(1), lambda n: 8 + 8 / n),
        "torch_mp ZeRO-1, overlap_param_gather": (zero(1, True), lambda n: 8 + 8 / n),
        "torch_mp ZeRO-2": (zero(2), lambda n: 4 + 12 / n),
        "torch_mp ZeRO-2, overlap_param_gather": (zero(2, True), lambda n: 4 + 12 / n),
        "torch_mp ZeRO-3": (zero(3), lambda n: 16 / n),
        "torch_mp bf16, fp32 grads + masters": (bf16, lambda n: 6 + 12 / n),
    }
    words = [w for w in args.only.split(",") if w]
    return {
        name: setup
        for name, setup in everything.items()
        if name.startswith("DDP") or not words or any(w in name for w in words)
    }


def barrier_time(fn, group) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - start


def stepper(built, args, mesh, after_backward=lambda: None) -> Callable[[], None]:
    """One training step of a built setup on this rank's batch."""
    wrapped, _, optimizer, dtype = built
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(mesh.dp_rank))
    inputs = x.to(dtype)

    def step() -> None:
        optimizer.zero_grad()
        wrapped(inputs).float().square().mean().backward()
        after_backward()
        optimizer.step()

    return step


def measure(build, args, mesh, timing_group) -> dict:
    with PeakMemory() as counter:
        built = build()
        wrapped, model, optimizer, dtype = built
        held = [0]  # what lives when the optimizer steps: gradients (and buffers) included
        step = stepper(built, args, mesh, lambda: held.__setitem__(0, counter.current))
        step()  # the state exists from the first step on
        between = counter.current
        counter.peak = 0
        times = [barrier_time(step, timing_group) for _ in range(args.steps)]
        peak = counter.peak + between  # the step's peak above what lived before it
        if isinstance(optimizer, torch_mp.DistributedOptimizer):
            optimizer.wait_for_parameters()  # (none of it runs during the next setup's steps)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if hasattr(next(model.parameters()), "to_local"):  # FSDP2: this rank's shards
        params = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    if getattr(wrapped, "shard_parameters", False):  # torch_mp ZeRO-3: the shards it steps
        params = sum(s.numel() * s.element_size() for s in optimizer._shards.shards)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps one
    state = state_bytes(getattr(inner, "state", {}))
    if not getattr(wrapped, "shard_parameters", False):  # (ZeRO-3's shards are its parameters)
        state += masters_bytes(optimizer)
    return {
        "params": params,
        "state": state,
        "rest": held[0] - params - state,
        "total": held[0],
        "peak": peak,
        "time": statistics.median(times),
    }


def alternating_times(builds: dict[str, Callable], args, mesh, timing_group) -> dict[str, float]:
    """The median step time of each setup, all built at once and stepped in turn, round after
    round (each round in another order), so that every setup sees the same machine: the ratios
    between them are what the speed claims rest on. In its turn a setup takes two steps and the
    second is timed: with ``overlap_param_gather`` that step's forward waits for the first
    step's all-gather, as in a training loop; then whatever it left running is waited for
    (untimed), so that none of it runs during another setup's turn."""
    steps, optimizers = {}, {}
    for name, build in builds.items():
        built = build()
        steps[name], optimizers[name] = stepper(built, args, mesh), built[2]
        steps[name]()  # the state exists from the first step on
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            steps[name]()
            times[name].append(barrier_time(steps[name], timing_group))
            if isinstance(optimizers[name], torch_mp.DistributedOptimizer):
                optimizers[name].wait_for_parameters()
    return {name: statistics.median(t) for name, t in times.items()}


def activation_memory(args) -> list[tuple[str, float, float]]:
    """Bytes saved for backward by one ParallelTransformerLayer (tp 1, dropout 0.1, fp32)
    without recomputation, with the layer's ``recompute`` options and under torch_mp.recompute,
    and the forward + backward time of each."""

    def layer(recompute=None):
        torch.manual_seed(0)
        return torch_mp.ParallelTransformerLayer(
            args.hidden, args.heads, 4 * args.hidden, dropout=0.1, recompute=recompute
        )

    plain = layer()
    x = torch.randn(args.seq, 1, args.hidden, requires_grad=True)
    rows = []
    for name, run in [
        ("none", plain),
        ('recompute="selective"', layer("selective")),
        ('recompute="full"', layer("full")),
        ("torch_mp.recompute(layer, x)", lambda t: torch_mp.recompute(plain, t)),
    ]:
        with PeakMemory() as counter:
            out = run(x)
            saved = counter.current - out.untyped_storage().nbytes()
        del out
        times = []
        for _ in range(9):
            start = time.perf_counter()
            run(x).sum().backward()
            times.append(time.perf_counter() - start)
        rows.append((name, saved, statistics.median(times)))
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    mesh = torch_mp.init(backend="gloo", timeout=120)
    timing = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), mesh.dp_size
    results = {}
    for name, (build, formula) in ({} if args.activations_only else setups(mesh, args)).items():
        try:
            results[name] = (measure(build, args, mesh, timing), formula(n))
        except Exception as e:  # noqa: BLE001  (a peer that cannot run here is reported)
            results[name] = (f"{type(e).__name__}: {str(e).splitlines()[0][:60]}", formula(n))
        dist.barrier()
    if rank == 0 and results:
        psi = args.layers * (args.width + 1) * args.width
        print(
            f"\n{args.layers} x Linear({args.width}, {args.width}): Psi = {psi / 1e6:.1f}M "
            f"parameters, dp = {n}, MB per rank\n"
        )
        print(
            "| setup | params | grads + buffers | optimizer state | total at the step | formula "
            "| step peak | step time |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, (r, formula) in results.items():
            if isinstance(r, str):
                print(f"| {name} | {r} | | | | {formula:.1f} Psi | | |")
                continue
            print(
                f"| {name} | {r['params'] / MB:.0f} | {r['rest'] / MB:.0f} | "
                f"{r['state'] / MB:.0f} | {r['total'] / MB:.0f} | "
                f"{formula:.1f} Psi = {formula * psi / MB:.0f} | {r['peak'] / MB:.0f} | "
                f"{r['time'] * 1e3:.0f} ms |"
            )
    if results and args.rounds:
        timed = {name: build for name, (build, _) in setups(mesh, args).items()}
        times = alternating_times(timed, args, mesh, timing)
        if rank == 0:
            print(
                f"\nStep times, every setup built at once and stepped in turn ({args.rounds} "
                "rounds, median):\n"
            )
            print("| setup | step time | / DDP | / ZeroRedundancyOptimizer |")
            print("|---|---|---|---|")
            ddp, zero = times["DDP + AdamW"], times["DDP + ZeroRedundancyOptimizer"]
            for name, t in times.items():
                print(f"| {name} | {t * 1e3:.0f} ms | {t / ddp:.2f} | {t / zero:.2f} |")
    if rank == 0:
        s, b, h, a = args.seq, 1, args.hidden, args.heads
        print(
            f"\nActivations of one ParallelTransformerLayer (s={s}, b={b}, h={h}, a={a}, fp32, "
            f"dropout 0.1); Korthikanti et al.'s sbh(34 + 5as/h) counts 16-bit tensors and 1-byte "
            f"masks: {s * b * h * (34 + 5 * a * s / h) / MB:.1f} MB in their units\n"
        )
        print("| recompute | saved for backward | forward + backward (median of 9) |")
        print("|---|---|---|")
        for name, saved, seconds in activation_memory(args):
            print(f"| {name} | {saved / MB:.1f} MB | {seconds * 1e3:.0f} ms |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
