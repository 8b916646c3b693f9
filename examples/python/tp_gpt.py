"""Trains a tensor-parallel GPT-style language model for a few steps and checks it against a
one-process copy.

The model is torch_mp.models.gpt's: token and learned position embeddings, pre-LN transformer
layers under a causal mask, a final LayerNorm and an output head tied to the token embedding. In
the parallel copy (one GPTStage holding the whole model) the vocabulary (embedding rows, logits)
is split across the ranks and padded when the group size does not divide it; the attention
heads and the MLP are split inside each layer; the loss is a vocabulary-parallel cross-entropy
that never gathers the logits. With ``--sequence-parallel`` the LayerNorms and residuals
between the layers act on each rank's chunk of the sequence.

Every rank also trains the dense model alone, from the same weights and data, as the reference.
Run on CPU with Gloo::

    torchrun --standalone --nproc-per-node=2 examples/python/tp_gpt.py  # ~6 s on 2 CPU cores
    torchrun --standalone --nproc-per-node=2 examples/python/tp_gpt.py --sequence-parallel
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import torch_mp
from torch_mp.models import DenseGPT, GPTConfig, GPTStage, dense_loss

TOLERANCE = 1e-5


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: this file's docstring as it is written, and every option's default."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split the LayerNorms and residuals along the sequence",
    )
    parser.add_argument("--vocab", type=int, default=1001, help="need not divide by the ranks")
    parser.add_argument("--seq", type=int, default=16, help="divisible by the ranks")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--hidden", type=int, default=32, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="divisible by the ranks")
    parser.add_argument("--ffn", type=int, default=64, help="divisible by the ranks")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate")
    args = parser.parse_args()

    mesh = torch_mp.init(tp=int(os.environ.get("WORLD_SIZE", "1")), backend="gloo", timeout=60)
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same dense model and data on every rank
    config = GPTConfig(args.vocab, args.seq, args.hidden, args.heads, args.ffn, args.layers)
    dense = DenseGPT(config)
    parallel = GPTStage(dense, range(args.layers), True, True, args.sequence_parallel)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1))
    inputs, target = tokens[:, :-1], tokens[:, 1:]  # predict the next token
    optimizers = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (dense, parallel)]
    losses = {
        dense: lambda: dense_loss(dense(inputs), target),
        parallel: lambda: parallel.loss(parallel(inputs), target),
    }

    tok = parallel.tok
    if rank == 0:
        print(
            f"tensor-parallel GPT on {mesh.tp_size} rank(s), sequence parallel "
            f"{'on' if args.sequence_parallel else 'off'}: vocabulary {args.vocab} padded to "
            f"{tok.num_embeddings_per_partition * mesh.tp_size} "
            f"({tok.num_embeddings_per_partition} rows per rank), {args.layers} layer(s) of "
            f"{parallel.layers[0]}"
        )
    worst_loss = 0.0
    for step in range(1, args.steps + 1):
        values = []
        for model, optimizer in zip((dense, parallel), optimizers, strict=True):
            optimizer.zero_grad()
            loss = losses[model]()
            loss.backward()
            optimizer.step()
            values.append(loss.item())
        diff = abs(values[0] - values[1])
        worst_loss = max(worst_loss, diff)
        if rank == 0:
            print(
                f"step {step}: loss {values[1]:.6f}  (one-process reference {values[0]:.6f}, "
                f"|diff| {diff:.2e})"
            )

    # The trained shards, gathered, must still be the reference's parameters, and the padded
    # rows of the last vocabulary shard must still be zero.
    worst_param = 0.0
    want = dict(dense.named_parameters())
    got = parallel.gathered()
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for name, value in got.items():
        worst_param = max(worst_param, (value - want[name]).abs().max().item())
    real_rows = max(0, min(args.vocab - tok.vocab_start_index, tok.num_embeddings_per_partition))
    padding = tok.weight[real_rows:]
    worst_param = max(worst_param, padding.abs().max().item() if padding.numel() else 0.0)

    # Every rank checked its own copy (replicated parameters included): report the worst.
    worst = torch.tensor([worst_loss, worst_param], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst_loss, worst_param = worst.tolist()
    ok = max(worst_loss, worst_param) <= TOLERANCE
    if rank == 0:
        print(
            f"agreement with the one-process reference: losses max |diff| {worst_loss:.2e}, "
            f"{len(got)} gathered parameters max |diff| {worst_param:.2e} "
            f"(tolerance {TOLERANCE:.0e}): {'OK' if ok else 'MISMATCH'}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
