"""Trains a Hugging Face Mixtral (a mixture-of-experts model) built from a small config (nothing
is downloaded) with its experts spread over expert-parallel ranks, and with ``--check`` compares
every step with the same recipe run on one process.

- Expert parallelism (``--ep``): ``torch_mp.parallelize`` with ``MIXTRAL_PLAN`` keeps every
  layer's sparse MoE block as it is called, but rank e of each expert group holds experts
  ``[e E / ep, (e + 1) E / ep)`` only: each rank routes its own tokens, sends every token to its
  experts' ranks by an all-to-all (the counts exchanged first) and gets the results back by a
  second one. The router is replicated, and the model's own load-balancing loss
  (``output_router_logits``) joins its loss as on one process.
- Tensor parallelism (``--tp``): the same plan splits the attention heads, the embedding's
  vocabulary and the head over the tensor group (each tensor rank runs the experts' block on
  the same tokens).
- Data parallelism: the ranks outside the tensor group (``world / tp``, of which the expert
  groups take ``ep`` consecutive ones), each on its share of every batch, under
  ``torch_mp.DataParallel``: the router's and attention's gradients averaged over the data
  group, the experts' over the ranks that hold the same experts. ``torch_mp.clip_grad_norm_``
  counts every expert once.

The one-process run: the same model, each data rank's share of the batch in turn (a
load-balancing loss is that of the tokens it sees), the gradients averaged, clipping to 1.0 and
AdamW. ``--check`` holds losses to 1e-5 (relative) and parameters to 1e-4 every step (sums over
ranks are taken in another order, and AdamW scales each element's update by its own gradient's
root mean square).

Run on CPU with Gloo (each about 16 s on 2 CPU cores)::

    torchrun --standalone --nproc-per-node=4 examples/python/mixtral_moe.py --ep 4 --check
    torchrun --standalone --nproc-per-node=4 examples/python/mixtral_moe.py --tp 2 --ep 2 --check
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
import transformers
from torch import nn

import torch_mp
from torch_mp import checkpoint
from torch_mp.models import Corpus
from torch_mp.parallelize import MIXTRAL_PLAN

LOSS_TOLERANCE, PARAMETER_TOLERANCE = 1e-5, 1e-4


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: this file's docstring as it is written, and every option's default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--ep", type=int, default=2, help="divides the data ranks")
    parser.add_argument("--experts", type=int, default=8, help="divisible by --ep")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--check", action="store_true", help="against the one-process run")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per data rank and step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="divisible by --tp")
    parser.add_argument("--ffn", type=int, default=96, help="each expert's")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    return parser.parse_args(argv)


def mixtral(args: argparse.Namespace, vocab: int) -> transformers.MixtralForCausalLM:
    config = transformers.MixtralConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.seq,
        output_router_logits=True,  # the load-balancing loss joins the loss
        attn_implementation="eager",
        use_cache=False,
    )
    torch.manual_seed(0)  # the same model on every rank
    return transformers.MixtralForCausalLM(config)


class OneProcess:
    """The recipe on one process: each data rank's share of the batch in turn, the gradients
    averaged over the shares, clipped to 1.0, AdamW."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self, shares: list[torch.Tensor]) -> float:
        self.optimizer.zero_grad()
        losses = []
        for ids in shares:
            loss = self.model(input_ids=ids, labels=ids).loss / len(shares)
            loss.backward()  # (gradients add up over the shares)
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return sum(losses)


def worst_difference(parallel: nn.Module, dense: nn.Module) -> tuple[str, float]:
    """The parameter (by its dense name) whose gathered value differs most from the dense
    model's, and by how much (a collective over the tensor and expert groups)."""
    expected = dense.state_dict()
    worst = ("", 0.0)
    for name, value in checkpoint.dense_state_dict(parallel).items():
        worst = max(worst, (name, (value - expected[name]).abs().max().item()), key=lambda w: w[1])
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = torch_mp.init(tp=args.tp, ep=args.ep, backend="gloo", timeout=120)
    rank = dist.get_rank()
    corpus = Corpus()
    dense = mixtral(args, corpus.vocab)
    reference = OneProcess(copy.deepcopy(dense), args.lr) if args.check else None
    model = torch_mp.parallelize(dense, mesh, plan=MIXTRAL_PLAN)
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        experts = f"{args.experts // args.ep} of {args.experts} experts per rank"
        print(
            f"Mixtral, {args.layers} layers of hidden size {args.hidden}, vocabulary "
            f"{corpus.vocab}: tp={mesh.tp_size} x dp={mesh.dp_size} ranks, ep={mesh.ep_size} "
            f"({experts}, top {args.top_k})",
            flush=True,
        )
    mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
    worst_loss, worst_parameter = 0.0, ("", 0.0)
    for step in range(1, args.steps + 1):
        ids, _ = corpus.batch(step, args.batch * mesh.dp_size, args.seq)
        optimizer.zero_grad()
        loss = wrapped(input_ids=ids[mine], labels=ids[mine]).loss
        loss.backward()
        torch_mp.clip_grad_norm_(model.parameters(), 1.0, mesh=mesh)
        optimizer.step()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean, group=mesh.dp_group)
        mean = mean.item() / mesh.dp_size
        line = f"step {step}/{args.steps}  loss {mean:.4f}"
        if reference is not None:
            expected = reference.step(list(ids.chunk(mesh.dp_size)))
            worst_loss = max(worst_loss, abs(mean - expected) / abs(expected))
            worst_parameter = max(
                worst_parameter, worst_difference(model, reference.model), key=lambda w: w[1]
            )
            line += f"  (one process: {expected:.4f})"
        if rank == 0:
            print(line, flush=True)
    ok = True
    if reference is not None:
        ok = worst_loss <= LOSS_TOLERANCE and worst_parameter[1] <= PARAMETER_TOLERANCE
        if rank == 0:
            print(
                f"agreement with the one-process reference: losses {worst_loss:.2e} relative "
                f"(tolerance {LOSS_TOLERANCE:.0e}), parameters max |diff| "
                f"{worst_parameter[1]:.2e}, in {worst_parameter[0]} "
                f"(tolerance {PARAMETER_TOLERANCE:.0e}): {'OK' if ok else 'FAILED'}",
                flush=True,
            )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
