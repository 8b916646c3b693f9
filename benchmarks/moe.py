"""A mixture-of-experts layer at 2 ranks: tokens per second of torch_mp.moe.MoE at ep = 2 (the
experts split over the ranks, tokens moved by all-to-all), against the dense module on one
process and against gathering every rank's tokens on every rank (each rank's experts then run
over the whole batch's tokens routed to them, the outputs reduce-scattered back), in one run;
and the share of the MoE's time in its two all-to-alls.

Run on CPU with Gloo::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/moe.py

Each setup runs forward and backward of the layer (defaults: hidden 512, ffn 2048, 8 experts,
top 2, 2048 tokens per rank, fp32), ``--steps`` timed steps after one untimed, the slowest
rank's median; the one-process module runs on rank 0 over both ranks' tokens while rank 1
waits. Outputs are checked against the dense module's first. The all-to-alls' share comes from
a profiler trace of one step (the operator ``torch_mp::all_to_all_rows``, forward and
backward). On 2 cores each rank has a core, and so has the one-process run: the ratios are what
splitting the experts saves per rank, not what a cluster with a fast network would show.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torch_mp
from torch_mp import _C, dense, functional


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    return parser.parse_args()


def median_seconds(step, steps: int, everyone: bool = True) -> float:
    step()
    times = []
    for _ in range(steps):
        if everyone:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


class Gathered(torch.nn.Module):
    """The peer: every rank's tokens gathered on every rank, this rank's experts run over the
    ones routed to them, the partial outputs reduce-scattered back (summing the ranks'
    experts)."""

    def __init__(self, moe: torch_mp.moe.MoE) -> None:
        super().__init__()
        self.moe, self.group = moe, moe.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        everyone = functional.gather_from_sp(x, group=self.group)  # backward reduce-scatters
        chosen, weights, _, _ = _C.moe_route(
            everyone, moe.router.weight, moe.top_k, moe.router_kind, None
        )
        local = moe.experts.num_experts
        first = dist.get_rank(self.group) * local
        y = torch.zeros_like(everyone)
        for i in range(local):
            rows, slots = (chosen == first + i).nonzero(as_tuple=True)
            out = moe.experts.expert(i, everyone[rows]) * weights[rows, slots, None]
            y = y.index_add(0, rows, out)
        return functional.reduce_scatter_to_sp(y, group=self.group)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    mesh = torch_mp.init(ep=2, backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = dense.MoE(args.hidden, args.ffn, args.experts, args.top_k)
    moe = torch_mp.moe.MoE.from_dense(reference)
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randn(args.tokens, args.hidden, generator=generator) for _ in range(world)]
    mine = tokens[rank]

    def dense_step():
        x = torch.cat(tokens).requires_grad_()
        y, aux = reference(x)
        (y.square().mean() + aux).backward()
        return y.detach()

    def moe_step():
        x = mine.clone().requires_grad_()
        y, aux = moe(x)
        (y.square().mean() + aux).backward()
        return y.detach()

    gathered = Gathered(moe)

    def gathered_step():
        x = mine.clone().requires_grad_()
        y = gathered(x)
        y.square().mean().backward()
        return y.detach()

    expected = reference(torch.cat(tokens))[0].detach()[rank * args.tokens :][: args.tokens]
    for step in (moe_step, gathered_step):
        assert torch.allclose(step(), expected, rtol=1e-4, atol=1e-5), step.__name__

    one = median_seconds(dense_step, args.steps, everyone=False) if rank == 0 else 0.0
    dist.barrier()
    one = slowest(one)
    split = slowest(median_seconds(moe_step, args.steps))
    peer = slowest(median_seconds(gathered_step, args.steps))
    dist.barrier()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        moe_step()
    wall = time.perf_counter() - start
    exchange = sum(
        e.cpu_time_total for e in profile.events() if e.name == "torch_mp::all_to_all_rows"
    )
    share = slowest(exchange / 1e6 / wall)  # forward's and backward's, of the profiled step

    if rank == 0:
        throughput = world * args.tokens
        print(
            f"MoE layer: hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top "
            f"{args.top_k}, {args.tokens} tokens per rank, fp32, forward + backward, ep = {world}; "
            f"median of {args.steps}, the slowest rank's"
        )
        print("| | step (ms) | tokens/s | vs one process |")
        print("|---|---|---|---|")
        for name, seconds in (
            ("one process, dense module, both ranks' tokens", one),
            (f"torch_mp.moe.MoE, ep = {world} (all-to-all)", split),
            (f"every rank's tokens gathered on every rank, ep = {world}", peer),
        ):
            print(
                f"| {name} | {1e3 * seconds:.0f} | {throughput / seconds:,.0f} | "
                f"{one / seconds:.2f}x |"
            )
        print(f"all-to-alls (forward and backward) of the MoE's step: {100 * share:.0f} %")
    del mesh
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
