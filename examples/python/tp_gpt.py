"""Trains a tensor-parallel GPT-style language model for a few steps and checks it against a
one-process copy.

The model: token and learned position embeddings, pre-LN transformer layers under a causal mask,
a final LayerNorm and an output head tied to the token embedding. In the parallel copy the
vocabulary (embedding rows, logits) is split across the ranks and padded when the group size
does not divide it; the attention heads and the MLP are split inside each layer; the loss is a
vocabulary-parallel cross-entropy that never gathers the logits. With ``--sequence-parallel``
the LayerNorms and residuals between the layers act on each rank's chunk of the sequence.

Every rank also trains the dense model alone, from the same weights and data, as the reference.
Run on CPU with Gloo::

    torchrun --standalone --nproc-per-node=2 examples/python/tp_gpt.py [--sequence-parallel]
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
from torch_mp import functional as tpf

TOLERANCE = 1e-5


class DenseGPT(nn.Module):
    """The one-process reference, on ``[s, b]`` token ids."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.tok = nn.Embedding(args.vocab, args.hidden)
        self.pos = nn.Embedding(args.seq, args.hidden)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                args.hidden,
                args.heads,
                args.ffn,
                dropout=0.0,
                activation="gelu",
                norm_first=True,
            )
            for _ in range(args.layers)
        )
        self.norm = nn.LayerNorm(args.hidden)
        with torch.no_grad():  # GPT-2's initialisation of the tied table (logits start small)
            self.tok.weight.normal_(std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[0]
        x = self.tok(tokens) + self.pos(torch.arange(s))[:, None]  # [s, b, h]
        mask = nn.Transformer.generate_square_subsequent_mask(s)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.tok.weight.T  # [s, b, vocab]


class ParallelGPT(nn.Module):
    """``DenseGPT`` sharded; returns this rank's ``[s, b, ceil(vocab / t)]`` slice of the logits."""

    def __init__(self, dense: DenseGPT, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.tok = torch_mp.VocabParallelEmbedding.from_dense(dense.tok)
        self.pos = copy.deepcopy(dense.pos)  # replicated on every rank
        self.layers = nn.ModuleList(
            torch_mp.ParallelTransformerLayer.from_dense(layer, sequence_parallel=sequence_parallel)
            for layer in dense.layers
        )
        self.norm = torch_mp.tensor_parallel.LayerNorm.from_dense(
            dense.norm, sequence_parallel=sequence_parallel
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[0]
        # Every rank computes the whole embedding (the vocab-parallel lookup all-reduces).
        x = self.tok(tokens) + self.pos(torch.arange(s))[:, None]
        if self.sequence_parallel:
            # This rank's chunk of the sequence. Not a plain x.chunk(t, 0)[rank]: that would give
            # the embeddings only this chunk's gradient; scatter_to_tp all-gathers the gradient,
            # so the tables (replicated position rows, vocab shards) get the whole sequence's.
            x = tpf.scatter_to_tp(x, dim=0)
        for layer in self.layers:
            x = layer(x, is_causal=True)
        h = self.norm(x)
        # Into the vocab-parallel head: under sequence parallelism gather the sequence back
        # (backward reduce-scatters), otherwise copy_to_tp (backward all-reduces).
        h = tpf.gather_from_sp(h) if self.sequence_parallel else tpf.copy_to_tp(h)
        return h @ self.tok.weight.T

    def gathered(self) -> dict[str, torch.Tensor]:
        """The parameters gathered back into ``DenseGPT``'s names (a collective)."""
        out = {"tok.weight": self.tok.to_dense().weight, "pos.weight": self.pos.weight}
        out.update({f"norm.{k}": v for k, v in self.norm.named_parameters()})
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn.to_dense()
            parts = {
                "self_attn.in_proj_weight": attention.in_proj_weight,
                "self_attn.in_proj_bias": attention.in_proj_bias,
                "self_attn.out_proj": attention.out_proj,
                "linear1": layer.mlp.fc1.to_dense(),
                "linear2": layer.mlp.fc2.to_dense(),
                "norm1": layer.norm1,
                "norm2": layer.norm2,
            }
            for name, part in parts.items():
                if isinstance(part, nn.Module):
                    out.update({f"layers.{i}.{name}.{k}": v for k, v in part.named_parameters()})
                else:
                    out[f"layers.{i}.{name}"] = part
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--vocab", type=int, default=1001, help="need not divide by the ranks")
    parser.add_argument("--seq", type=int, default=16, help="divisible by the ranks")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4, help="divisible by the ranks")
    parser.add_argument("--ffn", type=int, default=64, help="divisible by the ranks")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    mesh = torch_mp.init(tp=int(os.environ.get("WORLD_SIZE", "1")), backend="gloo", timeout=60)
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same dense model and data on every rank
    dense = DenseGPT(args)
    parallel = ParallelGPT(dense, args.sequence_parallel)
    tokens = torch.randint(args.vocab, (args.seq + 1, args.batch))
    inputs, target = tokens[:-1], tokens[1:]  # predict the next token
    optimizers = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in (dense, parallel)]

    def dense_loss() -> torch.Tensor:
        return F.cross_entropy(dense(inputs).flatten(0, 1), target.flatten())

    def parallel_loss() -> torch.Tensor:
        return torch_mp.vocab_parallel_cross_entropy(
            parallel(inputs), target, vocab_size=args.vocab
        )

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
        losses = []
        for loss_fn, optimizer in zip((dense_loss, parallel_loss), optimizers, strict=True):
            optimizer.zero_grad()
            loss = loss_fn()
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
