"""Peak memory (and time) of vocab_parallel_cross_entropy against the dense loss.

Per rank, forward + backward of the loss on a [tokens, V] logit tensor split along V, against
  dense:   F.cross_entropy on the whole [tokens, V] logits on one process (the reference), and
  gather:  all-gather the logits (torch_mp.functional.gather_from_tp) then F.cross_entropy,
           the obvious way to get the loss of sharded logits.
Memory is the peak of tensor storage allocated during the call and alive at once (the logits
themselves not counted, their gradient counted), measured at the dispatcher (torch_mp._memory),
so it works on the CPU. V defaults to GPT-2's 50257, which 4 does not divide (padded shards).

    .venv/bin/torchrun --standalone --nproc-per-node=4 \\
        benchmarks/cross_entropy_memory.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

import torch_mp
from torch_mp._memory import PeakMemory


def measure(loss_fn, logits: torch.Tensor, target: torch.Tensor, repeats: int, together=True):
    """(peak bytes, median seconds) of loss_fn(logits, target).backward(); ``together``: all
    ranks run it (and start each timed repeat at a barrier)."""
    times = []
    for i in range(repeats + 1):
        leaf = logits.detach().requires_grad_()
        if i == 0:
            with PeakMemory() as memory:
                loss_fn(leaf, target).backward()
            peak = memory.peak
            continue
        if together:
            dist.barrier()
        start = time.perf_counter()
        loss_fn(leaf, target).backward()
        times.append(time.perf_counter() - start)
    return peak, sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = torch_mp.init(tp=dist.get_world_size())
    t, r, vocab = mesh.tp_size, mesh.tp_rank, args.vocab
    start, rows, real = torch_mp._C.vocab_range(vocab, mesh.tp_group.group_name)

    torch.manual_seed(0)  # the same full logits and targets on every rank
    full = torch.randn(args.tokens, vocab)
    target = torch.randint(0, vocab, (args.tokens,))
    shard = full.new_zeros(args.tokens, rows)
    shard[:, :real] = full[:, start : start + real]
    padded = full.new_zeros(args.tokens, rows * t)
    padded[:, :vocab] = full

    def parallel(x, y):
        return torch_mp.vocab_parallel_cross_entropy(x, y, vocab_size=vocab)

    def gathered(x, y):
        return F.cross_entropy(torch_mp.functional.gather_from_tp(x)[:, :vocab], y)

    results = {
        "vocab_parallel_cross_entropy": measure(parallel, shard, target, args.repeats),
        "all-gather + F.cross_entropy": measure(gathered, shard, target, args.repeats),
    }
    dense = measure(F.cross_entropy, full, target, args.repeats, False) if r == 0 else None
    del padded
    everyone = [None] * t
    dist.all_gather_object(everyone, results)
    if r == 0:
        mib = 2**20
        shard_mib = args.tokens * rows * 4 / mib
        print(
            f"tokens={args.tokens} vocab={vocab} ranks={t} shard=[{args.tokens}, {rows}] "
            f"({shard_mib:.1f} MiB fp32); dense logits {args.tokens * vocab * 4 / mib:.1f} MiB"
        )
        print("| loss | peak per rank (MiB, max over ranks) | / dense | / shard | time (s) |")
        print("|---|---|---|---|---|")
        print(
            f"| F.cross_entropy, one process | {dense[0] / mib:.1f} | 1.00 | "
            f"{dense[0] / mib / shard_mib:.2f} | {dense[1]:.4f} |"
        )
        for name in results:
            peak = max(e[name][0] for e in everyone)
            seconds = max(e[name][1] for e in everyone)
            print(
                f"| {name} | {peak / mib:.1f} | {peak / dense[0]:.2f} | "
                f"{peak / mib / shard_mib:.2f} | {seconds:.4f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
