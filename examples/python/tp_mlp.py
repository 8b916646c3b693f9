"""Trains a tensor-parallel MLP for a few steps and checks it against a one-process copy.

Each rank holds a column-parallel first layer and a row-parallel second layer (one all-reduce
forward, one backward). Every rank also trains the dense MLP alone, from the same weights and
data, as the reference. Run on CPU with Gloo::

    torchrun --standalone --nproc-per-node=2 examples/python/tp_mlp.py  # ~6 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import torch_mp

TOLERANCE = 1e-5


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: this file's docstring as it is written, and every option's default."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    args = parser.parse_args()

    mesh = torch_mp.init(tp=int(os.environ.get("WORLD_SIZE", "1")), backend="gloo", timeout=60)
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same dense model and data on every rank
    dense = nn.Sequential(nn.Linear(32, args.hidden), nn.GELU(), nn.Linear(args.hidden, 16))
    parallel = nn.Sequential(
        torch_mp.ColumnParallelLinear.from_dense(dense[0]),
        nn.GELU(),
        torch_mp.RowParallelLinear.from_dense(dense[2]),
    )
    x, target = torch.randn(64, 32), torch.randn(64, 16)
    optimizers = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (dense, parallel)]

    if rank == 0:
        print(f"tensor-parallel MLP on {mesh.tp_size} rank(s): {parallel}")
    worst = 0.0
    for step in range(1, args.steps + 1):
        losses = []
        for model, optimizer in zip((dense, parallel), optimizers, strict=True):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        diff = abs(losses[0] - losses[1])
        worst = max(worst, diff)
        if rank == 0:
            print(
                f"step {step}: loss {losses[1]:.6f}  (one-process reference {losses[0]:.6f}, "
                f"|diff| {diff:.2e})"
            )

    # The trained shards, gathered, must still be the reference's weights.
    for layer, reference in ((parallel[0], dense[0]), (parallel[2], dense[2])):
        gathered = layer.to_dense()
        for name in ("weight", "bias"):
            got, want = getattr(gathered, name), getattr(reference, name)
            worst = max(worst, (got - want).abs().max().item())
    ok = worst <= TOLERANCE
    if rank == 0:
        print(
            f"agreement with the one-process reference: max |diff| {worst:.2e} "
            f"(tolerance {TOLERANCE:.0e}): {'OK' if ok else 'MISMATCH'}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
