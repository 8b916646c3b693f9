"""The data-parallel collectives on this machine's backend, side by side: one bucket's all-reduce
against its reduce-scatter (as a list and as one tensor) and its all-gather.

On Gloo the reduce-scatter is slower than the all-reduce of the whole bucket, so ZeRO-2 and
ZeRO-3 all-reduce their gradient buckets there and keep their own range (sharded_state);
this benchmark is what that choice rests on. Each round times every collective once, in turn,
and the medians are printed with their ratio to the all-reduce::

    torchrun --standalone --nproc-per-node=2 benchmarks/collectives.py  # ~10 s
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--mb", type=float, default=25.0, help="bucket size (fp32)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    numel = int(args.mb * 1e6 / 4) // size * size
    bucket, shard = torch.randn(numel), torch.randn(numel // size)
    gathered, scattered = torch.empty(numel), torch.empty(numel // size)
    # (torch 2.14 names them *_single; the older names still work, with a warning)
    scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    collectives = {
        "all_reduce": lambda: dist.all_reduce(bucket),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(scattered, list(bucket.chunk(size))),
        "reduce_scatter (one tensor)": lambda: scatter_single(scattered, bucket),
        "all_gather (one tensor)": lambda: gather_single(gathered, shard),
    }
    times: dict[str, list[float]] = {name: [] for name in collectives}
    for collective in collectives.values():
        collective()  # (warm)
    for _ in range(args.rounds):
        for name, collective in collectives.items():
            dist.barrier()
            start = time.perf_counter()
            collective()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        base = statistics.median(times["all_reduce"])
        print(f"{dist.get_backend()}, {size} ranks, {numel * 4 / 1e6:.0f} MB buckets\n")
        print("| collective | median | / all_reduce |\n|---|---|---|")
        for name, measured in times.items():
            median = statistics.median(measured)
            print(f"| {name} | {median * 1e3:.1f} ms | {median / base:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
