"""Context-parallel attention at 2 ranks: step time and peak memory per rank of causal attention
over a long sequence, by each method of torch_mp.context_parallel.attention ("ring",
"all_gather", "all_to_all"), against attention over the whole sequence on one process and
against torch's ``torch.distributed.tensor.experimental.context_parallel``, in one run.

Run on CPU with Gloo::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/context_parallel.py

Each setup runs forward and backward of causal attention on ``[batch, heads, seq, head_dim]``
(defaults 1 x 8 x 4096 x 64, fp32), ``--steps`` timed steps after one untimed, the slowest
rank's median; the one-process reference runs on rank 0 while rank 1 waits. Peak memory is
what torch_mp's dispatcher-level counter (``torch_mp._memory.PeakMemory``) sees allocated on the
calling thread during a step, inputs included. Every output is checked against the one-process
one first. The ring's share of time spent waiting for K/V transfers rather than computing comes
from a profiler trace of one step (the core's ``torch_mp::ring_attention compute`` and ``wait``
ranges). On 2 cores the two ranks have a core each: the one-process reference has one too, so
the ratios are what splitting the sequence saves per rank, not what a cluster would show.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_mp
from torch_mp import context_parallel as cp
from torch_mp._memory import PeakMemory

MB = 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    return parser.parse_args()


def whole_inputs(args) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    return [torch.randn(shape, generator=generator) for _ in range(4)]  # q, k, v, grad


def measure(step, steps: int) -> tuple[float, float, torch.Tensor]:
    """(median seconds, peak MB, output) of ``step()`` -> (output, grad_out) forward+backward,
    the slowest rank's."""
    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
    with PeakMemory() as peak:
        out = step()
    result = torch.tensor([statistics.median(times), peak.peak / MB], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return result[0].item(), result[1].item(), out


def ring_wait_share(step) -> float:
    """The share of the ring's time spent waiting for transfers, from a profiler trace."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    totals = {"compute": 0.0, "wait": 0.0}
    for event in profile.events():
        for kind in totals:
            if event.name == f"torch_mp::ring_attention {kind}":
                totals[kind] += event.cpu_time_total
    share = torch.tensor([totals["wait"] / max(1e-9, sum(totals.values()))])
    dist.all_reduce(share, op=dist.ReduceOp.MAX)
    return share.item()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = torch_mp.init(cp=world)
    rank = dist.get_rank()
    q, k, v, grad = whole_inputs(args)

    def whole_step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(grad)
        return out.detach()

    rows: dict[str, tuple[float, float] | str] = {}
    if rank == 0:
        one = measure_alone(whole_step, args.steps)
    dist.barrier()
    expected = whole_step() if rank == 0 else None
    parts = [cp.shard_sequence(t, 2) for t in (q, k, v, grad)]

    def method_step(method: str):
        def step():
            leaves = [t.clone().requires_grad_() for t in parts[:3]]
            out = cp.attention(*leaves, is_causal=True, method=method)
            out.backward(parts[3])
            return out.detach()

        return step

    wait_share = None
    for method in cp.METHODS:
        seconds, peak, out = measure(method_step(method), args.steps)
        whole = cp.unshard_sequence(out, 2)
        if rank == 0:
            assert torch.allclose(whole, expected, rtol=1e-4, atol=1e-5), method
        rows[method] = (seconds, peak)
        if method == "ring":
            wait_share = ring_wait_share(method_step(method))
    rows["torch context_parallel"] = torch_context_parallel(args, q, k, v, grad, mesh)

    if rank == 0:
        seconds, peak = one
        print(
            f"causal attention, [{args.batch}, {args.heads}, {args.seq}, {args.head_dim}] fp32, "
            f"forward + backward, cp = {world} (per rank: s = {args.seq // world}); median of "
            f"{args.steps}, the slowest rank's"
        )
        print("| | step (ms) | vs one process | peak memory per rank (MB) | vs one process |")
        print("|---|---|---|---|---|")
        print(f"| one process, whole sequence | {1e3 * seconds:.0f} | 1.00 | {peak:.0f} | 1.00 |")
        for name, row in rows.items():
            if isinstance(row, str):
                print(f"| {name} | {row} | | | |")
                continue
            s, p = row
            print(
                f"| torch_mp {name} | {1e3 * s:.0f} | {s / seconds:.2f} | {p:.0f} | "
                f"{p / peak:.2f} |"
            )
        print(f"ring: {100 * wait_share:.0f} % of its time waiting for K/V transfers (profiler)")
    dist.destroy_process_group()


def measure_alone(step, steps: int) -> tuple[float, float]:
    """(median seconds, peak MB) of ``step`` on this process alone."""
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with PeakMemory() as peak:
        step()
    return statistics.median(times), peak.peak / MB


def torch_context_parallel(args, q, k, v, grad, mesh) -> tuple[float, float] | str:
    """torch's experimental context_parallel over the same inputs, or why it cannot run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))

        def step():
            leaves = [t.clone() for t in (q, k, v)]
            g = grad.clone()
            buffers = [*leaves, g]  # sharded in place, not restored (they require grad then)
            with context_parallel(
                device_mesh,
                buffers=buffers,
                buffer_seq_dims=[2] * 4,
                no_restore_buffers=set(buffers),
            ):
                for leaf in leaves:  # (sharded in place by now)
                    leaf.requires_grad_()
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                out.backward(g)
            return out.detach()

        seconds, peak, _ = measure(step, args.steps)
        return seconds, peak
    except Exception as e:  # noqa: BLE001  (reported in the table, on every rank alike)
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"does not run here: {type(e).__name__}: {first_line[:120]}"


if __name__ == "__main__":
    main()
