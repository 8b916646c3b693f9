"""Trains a tensor-parallel CNN for a few steps and checks it against a one-process copy.

Each convolutional block is ``conv2(relu(norm(conv1(x))))`` with its middle channels split across
the ranks: a column-parallel first convolution (this rank's output channels), a BatchNorm over
those channels, a row-parallel second convolution whose partial outputs are all-reduced (one
all-reduce forward, one backward per block). The classifier after the global average pool is
replicated: its input, the all-reduced block output, is the same on every rank, and so is its
gradient. Every rank also trains the dense CNN alone, from the same weights and data, as the
reference. Run on CPU with Gloo::

    torchrun --standalone --nproc-per-node=2 examples/python/tp_cnn.py  # ~6 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import torch_mp
from torch_mp.dense import ConvBlock

TOLERANCE = 1e-5


def gathered(block: torch_mp.ParallelConvBlock) -> dict[str, torch.Tensor]:
    """A parallel block's parameters and BatchNorm statistics in ``ConvBlock``'s names (a
    collective)."""
    out = {}
    for name in ("conv1", "conv2"):
        out.update(
            {f"{name}.{k}": v for k, v in getattr(block, name).to_dense().named_parameters()}
        )
    with torch.no_grad():
        for key in ("weight", "bias", "running_mean", "running_var"):
            shard = getattr(block.norm, key)
            out[f"norm.{key}"] = torch_mp.functional.gather_from_tp(shard, block.group, dim=0)
    return out


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: this file's docstring as it is written, and every option's default."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--batch", type=int, default=16, help="images per step")
    parser.add_argument("--size", type=int, default=16, help="image height and width")
    parser.add_argument("--classes", type=int, default=10, help="output classes")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    args = parser.parse_args()

    mesh = torch_mp.init(tp=int(os.environ.get("WORLD_SIZE", "1")), backend="gloo", timeout=60)
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same dense model and data on every rank
    dense = nn.Sequential(
        ConvBlock(3, 16, 16),  # middle channels (16, then 32) divisible by the ranks
        nn.ReLU(),
        nn.MaxPool2d(2),
        ConvBlock(16, 32, 16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, args.classes),
    )
    parallel = nn.Sequential(
        *(
            torch_mp.ParallelConvBlock.from_dense(m)
            if isinstance(m, ConvBlock)
            else copy.deepcopy(m)
            for m in dense
        )
    )
    images = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(args.classes, (args.batch,))
    optimizers = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (dense, parallel)]

    if rank == 0:
        print(f"tensor-parallel CNN on {mesh.tp_size} rank(s): {parallel}")
    worst_loss = 0.0
    for step in range(1, args.steps + 1):
        losses = []
        for model, optimizer in zip((dense, parallel), optimizers, strict=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        diff = abs(losses[0] - losses[1])
        worst_loss = max(worst_loss, diff)
        if rank == 0:
            print(
                f"step {step}: loss {losses[1]:.6f}  (one-process reference {losses[0]:.6f}, "
                f"|diff| {diff:.2e})"
            )

    # The trained shards, gathered, must still be the reference's weights (and BatchNorm running
    # statistics); the replicated classifier must equal the reference's on every rank.
    worst_param = 0.0
    compared = 0
    for mine, reference in zip(parallel, dense, strict=True):
        if isinstance(reference, ConvBlock):
            got = gathered(mine)
            want = {k: v for k, v in reference.state_dict().items() if k in got}
        else:
            got, want = dict(mine.named_parameters()), dict(reference.named_parameters())
        assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
        for name, value in got.items():
            worst_param = max(worst_param, (value - want[name]).abs().max().item())
        compared += len(got)

    # Every rank checked its own copy (the replicated classifier included): report the worst.
    worst = torch.tensor([worst_loss, worst_param], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst_loss, worst_param = worst.tolist()
    ok = max(worst_loss, worst_param) <= TOLERANCE
    if rank == 0:
        print(
            f"agreement with the one-process reference: losses max |diff| {worst_loss:.2e}, "
            f"{compared} gathered tensors max |diff| {worst_param:.2e} "
            f"(tolerance {TOLERANCE:.0e}): {'OK' if ok else 'MISMATCH'}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
