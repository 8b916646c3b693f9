"""Checkpoint save and load throughput per rank: torch_mp.checkpoint beside torch.save/torch.load;
what a save stalls a training loop, with ``save`` and with ``async_save``; what the checksums
cost.

Run on CPU with Gloo (2 ranks, tensor parallel)::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/checkpoint.py

The model is ``--layers`` ``ParallelTransformerLayer``s of hidden size ``--hidden`` (ffn 4x),
tensor-parallel over the ranks, with AdamW state after one step (moments and step count): each
rank holds a third of its bytes in weights, two thirds in moments. Both sides handle the same
tensors of each rank:

- torch_mp: ``checkpoint.save`` (each rank writes its own shard file, in the dense model's
  names; fsync, index, rename into place) and ``checkpoint.load`` into a model of other values
  (each rank reads the blocks it holds and copies them in);
- torch: ``torch.save`` of this rank's model and optimizer ``state_dict`` to a file of its own,
  and ``torch.load`` of it with ``load_state_dict``: no resharding, the lower bound of what a
  checkpoint costs; once as it is (the file may still be in the page cache when it returns),
  once followed by ``fsync`` (on disk, as durable as ours, which fsyncs every file).

MB/s is this rank's bytes (weights and optimizer state; 10^6 bytes) over the slowest rank's
time, median of ``--repeats`` rounds, alternating the two sides. Files go to ``--dir`` (default:
a temporary directory), so loads read from the page cache as a resume right after a save does.

Then a training loop (forward, backward and AdamW step of the same model on one batch) runs
``--steps`` steps three times: without saving, with ``checkpoint.save`` every ``--save-every``
steps (not after the last steps), and with ``checkpoint.async_save`` (the last one waited for
at the end): how long each save call held the loop up, and the whole loop's time against the
one without saves. Last, the CRC-32C that
every block is written with, over this rank's bytes, against the save's own time, and
``checkpoint.verify`` of the checkpoint against its load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import torch_mp
from torch_mp import _C, checkpoint

MB = 1e6


def build(hidden: int, layers: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        *(
            torch_mp.ParallelTransformerLayer(hidden, hidden // 64, 4 * hidden)
            for _ in range(layers)
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 2, hidden)
    model(x).square().mean().backward()
    optimizer.step()
    return model, optimizer


def local_bytes(model, optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def training_loop(model, optimizer, args, mesh, path) -> dict[str, tuple[list[float], float]]:
    """Per setup: how long each save call held the loop up, and the whole loop's time (the
    slowest rank's)."""
    x = torch.randn(16, 2, args.hidden)
    results = {}
    for what in ("no saves", "save", "async_save"):
        stalls: list[float] = []
        dist.barrier()
        start = time.perf_counter()
        saving = None
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            # No save after the last steps: each has --save-every steps to overlap with.
            if what != "no saves" and step % args.save_every == 0 and step < args.steps:
                called = time.perf_counter()
                if what == "save":
                    checkpoint.save(path, model, optimizer, mesh=mesh)
                else:
                    saving = checkpoint.async_save(path, model, optimizer, mesh=mesh)
                stalls.append(time.perf_counter() - called)
        if saving is not None:
            saving.wait()
        total = torch.tensor([time.perf_counter() - start, *stalls], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        results[what] = (total[1:].tolist(), total[0].item())
    return results


def crc_seconds(model, optimizer) -> float:
    """The time of the CRC-32C of every tensor this rank saves (median of 5)."""
    tensors = [p.detach() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for tensor in tensors:
            _C.checkpoint.crc32c(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="of the training loop")
    parser.add_argument("--save-every", type=int, default=4, help="of the training loop")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = torch_mp.init(tp=dist.get_world_size())
    rank = dist.get_rank()
    root = [args.dir or tempfile.mkdtemp(prefix="torch_mp_ckpt_bench_") if rank == 0 else None]
    dist.broadcast_object_list(root)
    root = root[0]

    model, optimizer = build(args.hidden, args.layers, 0)
    other, other_optimizer = build(args.hidden, args.layers, 1)
    nbytes = local_bytes(model, optimizer)
    ours_dir = os.path.join(root, "torch_mp")
    theirs = os.path.join(root, f"torch-{rank}.pt")

    def torch_save() -> None:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, theirs)

    def torch_save_synced() -> None:  # as durable as ours: on disk before it returns
        with open(theirs, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load() -> None:
        state = torch.load(theirs)
        other.load_state_dict(state["model"])
        other_optimizer.load_state_dict(state["optim"])

    kinds = ("ours save", "ours load", "torch save", "torch save+fsync", "torch load")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        times["ours save"].append(
            timed(lambda: checkpoint.save(ours_dir, model, optimizer, mesh=mesh))
        )
        times["torch save"].append(timed(torch_save))
        times["torch save+fsync"].append(timed(torch_save_synced))
        times["ours load"].append(timed(lambda: checkpoint.load(ours_dir, other, other_optimizer)))
        times["torch load"].append(timed(torch_load))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):  # it did load
        assert torch.equal(p, q)

    median = {k: statistics.median(v) for k, v in times.items()}
    loop = training_loop(model, optimizer, args, mesh, os.path.join(root, "loop"))
    crc = crc_seconds(model, optimizer)
    verify_seconds = timed(lambda: checkpoint.verify(ours_dir))
    if rank == 0:
        print(
            f"checkpoint throughput: {args.layers} x ParallelTransformerLayer({args.hidden}) at "
            f"tp = {mesh.tp_size}, AdamW state; {nbytes / MB:.0f} MB per rank; median of "
            f"{args.repeats}; files in {root}"
        )
        print(
            "| | torch_mp MB/s per rank | torch.save/load MB/s per rank | torch_mp / torch (time) |"
        )
        print("|---|---|---|---|")
        for what in ("save", "save+fsync", "load"):
            ours, base = median[f"ours {what.split('+')[0]}"], median[f"torch {what}"]
            rates = f"{nbytes / MB / ours:.0f} | {nbytes / MB / base:.0f}"
            print(f"| {what} | {rates} | {ours / base:.2f} |")
        print(
            f"\ntraining loop: {args.steps} steps, a checkpoint every {args.save_every} "
            "(the slowest rank's times)"
        )
        print("| | each save call held the loop (ms, median) | loop (s) | loop / no saves |")
        print("|---|---|---|---|")
        for what, (stalls, total) in loop.items():
            held = f"{1e3 * statistics.median(stalls):.0f}" if stalls else "-"
            print(f"| {what} | {held} | {total:.2f} | {total / loop['no saves'][1]:.2f} |")
        print(
            f"\nCRC-32C over this rank's {nbytes / MB:.0f} MB: {1e3 * crc:.0f} ms "
            f"({nbytes / crc / 1e9:.1f} GB/s), {100 * crc / median['ours save']:.0f} % of a "
            f"save's time; checkpoint.verify (all {mesh.tp_size} files, on one rank at a time): "
            f"{1e3 * verify_seconds:.0f} ms against {1e3 * median['ours load']:.0f} ms to load"
        )
    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
