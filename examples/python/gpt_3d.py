"""Trains a small GPT on data x pipeline x tensor parallel ranks ("3D"), and with ``--check``
compares it with the same model trained on one process.

The model: token and learned position embeddings, pre-LN transformer layers under a causal mask,
a final LayerNorm and an output head tied to the token embedding, trained character by character
on this repository's README with AdamW and gradient clipping.

- Tensor parallelism (``--tp``): the vocabulary (embedding rows, logits, loss), the attention
  heads and the MLP are split across the tensor group; ``--sequence-parallel`` also splits the
  LayerNorms and residuals along the sequence.
- Pipeline parallelism (``--pp``, ``--schedule``): the layers are cut into stages; the first holds
  the embeddings, the last the final norm and the head. The head is a copy of the embedding tied
  to it across the pipeline (its gradient summed with the embedding's after every step).
- Data parallelism (``--dp``): every replica sees its own share of each batch; each stage is
  wrapped in ``torch_mp.DataParallel`` (or, with ``--ddp``, PyTorch's DistributedDataParallel)
  and the gradients are averaged once per step.

- Checkpoints (``--save-every N --checkpoint DIR``, ``--resume``): model and AdamW state in the
  dense model's names (torch_mp.checkpoint), so a run saved at one layout resumes at another.

Run on CPU with Gloo (tp * pp * dp processes)::

    torchrun --standalone --nproc-per-node=8 examples/python/gpt_3d.py \\
        --tp 2 --pp 2 --dp 2 --schedule 1f1b --check

Killed and relaunched, it continues from its last checkpoint (``--fail-at-step`` kills rank 1
once, to try it)::

    torchrun --standalone --nproc-per-node=2 --max-restarts 1 examples/python/gpt_3d.py \\
        --pp 2 --save-every 2 --resume --fail-at-step 5 --check
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp import checkpoint, pipeline
from torch_mp import functional as tpf

# Losses agree to fp32 rounding of sums taken in other orders. Parameters after AdamW agree less
# tightly: AdamW moves every element by lr * m / sqrt(v), so an element inherits the *relative*
# error of its own gradient, which is large for the few entries whose gradient is tiny next to
# the terms summed into it (an absolute error of 1e-9 on a gradient of 1e-6 is 1e-3 relative).
LOSS_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = 1e-4
CORPUS = Path(__file__).resolve().parents[2] / "README.md"


class Corpus:
    """Characters of a text file as token ids, cut into random windows (the same on every rank)."""

    def __init__(self, path: Path = CORPUS) -> None:
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` windows for ``step``: inputs and next-token targets, each ``[batch, seq]``."""
        g = torch.Generator().manual_seed(1000 + step)
        starts = torch.randint(len(self.ids) - seq - 1, (batch,), generator=g)
        windows = torch.stack([self.ids[s : s + seq + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


class DenseGPT(nn.Module):
    """The one-process model, on ``[b, s]`` token ids; returns ``[s, b, vocab]`` logits.

    The transformer layers have no biases (as in PaLM or LLaMA). With them, the attention's key
    bias would have a gradient that is exactly zero in exact arithmetic (softmax ignores a
    constant added to a row of scores) and rounding noise of ~1e-10 in practice, which AdamW
    turns into updates of lr * noise / eps: noise that no two summation orders share.
    """

    def __init__(self, vocab: int, args: argparse.Namespace) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, args.hidden)
        self.pos = nn.Embedding(args.seq, args.hidden)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                args.hidden,
                args.heads,
                args.ffn,
                dropout=0.0,
                activation="gelu",
                norm_first=True,
                bias=False,
            )
            for _ in range(args.layers)
        )
        self.norm = nn.LayerNorm(args.hidden)
        with torch.no_grad():  # GPT-2's initialisation of the tied table (logits start small)
            self.tok.weight.normal_(std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.T  # [s, b]
        s = tokens.shape[0]
        x = self.tok(tokens) + self.pos(torch.arange(s))[:, None]
        mask = nn.Transformer.generate_square_subsequent_mask(s)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.tok.weight.T


def dense_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.T.flatten())


class GPTStage(nn.Module):
    """One pipeline stage of ``DenseGPT``, tensor-parallel: layers ``layers`` of the dense model,
    plus the embeddings on the first stage and the final norm and (tied) head on the last.

    The first stage takes ``[b, s]`` token ids; stages pass ``[s, b, h]`` activations
    (``[s / t, b, h]`` under sequence parallelism); the last returns this rank's
    ``[s, b, ceil(vocab / t)]`` slice of the logits.
    """

    def __init__(
        self, dense: DenseGPT, layers: range, first: bool, last: bool, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.first, self.last, self.sequence_parallel = first, last, sequence_parallel
        self.layer_ids = layers
        if first:
            self.tok = torch_mp.VocabParallelEmbedding.from_dense(dense.tok)
            self.pos = copy.deepcopy(dense.pos)  # replicated on every rank
        self.layers = nn.ModuleList(
            torch_mp.ParallelTransformerLayer.from_dense(
                dense.layers[i], sequence_parallel=sequence_parallel
            )
            for i in layers
        )
        if last:
            self.norm = torch_mp.tensor_parallel.LayerNorm.from_dense(
                dense.norm, sequence_parallel=sequence_parallel
            )
            # One stage holds both ends: the head is the embedding itself. Otherwise a copy,
            # tied to the first stage's through Pipeline(tied_parameters=...).
            self.head = self.tok if first else torch_mp.VocabParallelEmbedding.from_dense(dense.tok)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            tokens = x.T
            s = tokens.shape[0]
            x = self.tok(tokens) + self.pos(torch.arange(s))[:, None]
            if self.sequence_parallel:
                x = tpf.scatter_to_tp(x, dim=0)  # this rank's chunk of the sequence
        for layer in self.layers:
            x = layer(x, is_causal=True)
        if not self.last:
            return x
        h = self.norm(x)
        h = tpf.gather_from_sp(h) if self.sequence_parallel else tpf.copy_to_tp(h)
        return h @ self.head.weight.T

    def dense_names(self) -> dict[str, str]:
        """How this stage's names map to ``DenseGPT``'s, for torch_mp.checkpoint: its layers
        renumbered, and the head, tied to the embedding, to the embedding's name."""
        names = {f"layers.{j}.": f"layers.{i}." for j, i in enumerate(self.layer_ids)}
        names["head.weight"] = "tok.weight"
        return names

    def gathered(self) -> dict[str, torch.Tensor]:
        """This stage's parameters gathered into ``DenseGPT``'s names (a tensor-group
        collective); the head under the name ``head.weight``."""
        out: dict[str, torch.Tensor] = {}
        if self.first:
            out["tok.weight"] = self.tok.to_dense().weight
            out["pos.weight"] = self.pos.weight
        for i, layer in zip(self.layer_ids, self.layers, strict=True):
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
                elif part is not None:
                    out[f"layers.{i}.{name}"] = part
        if self.last:
            out.update({f"norm.{k}": v for k, v in self.norm.named_parameters()})
            out["head.weight"] = self.head.to_dense().weight
        return out


def build_stages(
    dense: DenseGPT, mesh: torch_mp.Mesh, stages_per_rank: int, sequence_parallel: bool
) -> list[GPTStage]:
    """This rank's stages (``mesh.pp_rank``, ``+ pp``, ...) of ``dense`` cut into
    ``pp * stages_per_rank`` stages of equal numbers of layers."""
    num_stages = mesh.pp_size * stages_per_rank
    layers = len(dense.layers)
    if layers % num_stages:
        raise ValueError(f"{layers} layers cannot be cut into {num_stages} equal stages")
    per_stage = layers // num_stages
    return [
        GPTStage(
            dense,
            range(s * per_stage, (s + 1) * per_stage),
            first=s == 0,
            last=s == num_stages - 1,
            sequence_parallel=sequence_parallel,
        )
        for s in range(mesh.pp_rank, num_stages, mesh.pp_size)
    ]


class Trainer3D:
    """The GPT's stages on this rank, wrapped for data parallelism and driven by a Pipeline."""

    def __init__(
        self,
        dense: DenseGPT,
        mesh: torch_mp.Mesh,
        args: argparse.Namespace,
        vocab: int,
    ) -> None:
        self.mesh, self.args, self.vocab = mesh, args, vocab
        spr = 2 if args.schedule == "interleaved_1f1b" else 1
        self.stages = build_stages(dense, mesh, spr, args.sequence_parallel)
        if args.ddp:
            wrapped = [DistributedDataParallel(s, process_group=mesh.dp_group) for s in self.stages]
        else:
            wrapped = [torch_mp.DataParallel(s, mesh=mesh) for s in self.stages]
        tied = [s.tok.weight for s in self.stages if s.first and not s.last]
        tied += [s.head.weight for s in self.stages if s.last and not s.first]
        self.pipe = pipeline.Pipeline(
            wrapped,
            args.schedule,
            args.microbatches,
            loss_fn=self.loss,
            mesh=mesh,
            tied_parameters=tied,
        )
        self.parameters = [p for s in self.stages for p in s.parameters()]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=args.lr, weight_decay=0.01)
        self.holds_first = self.stages[0].first
        self.holds_last = self.stages[-1].last

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch_mp.vocab_parallel_cross_entropy(logits, target.T, vocab_size=self.vocab)

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        """One optimizer step on this data rank's share of the batch; returns the loss of the
        whole batch (mean over the data ranks), the same on every rank."""
        loss = self.compute_gradients(inputs, target)
        self.optimizer.step()
        return loss

    def compute_gradients(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        """The step without the optimizer: gradients averaged over the data ranks, tied copies
        summed, clipped over the mesh."""
        self.optimizer.zero_grad()
        loss = self.pipe.step(
            inputs if self.holds_first else None, target=target if self.holds_last else None
        )
        torch_mp.clip_grad_norm_(self.parameters, self.args.clip, mesh=self.mesh)
        # Share the last stage's loss: counted once per data rank (tensor rank 0), averaged.
        counted = loss is not None and self.mesh.tp_rank == 0
        value = torch.tensor([loss.item() if counted else 0.0], dtype=torch.float64)
        dist.all_reduce(value)
        return value.item() / self.mesh.dp_size

    def gathered(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            out.update(stage.gathered())
        return out

    def save(self, path: str, step: int) -> None:
        """Saves the model and the optimizer in DenseGPT's names (every rank): loadable at
        any other tp x pp x dp."""
        renames = [stage.dense_names() for stage in self.stages]
        checkpoint.save(path, self.stages, self.optimizer, {"step": step}, rename=renames)

    def load(self, path: str) -> int:
        """Loads a checkpoint saved at any layout; returns the step it was saved after."""
        renames = [stage.dense_names() for stage in self.stages]
        return checkpoint.load(path, self.stages, self.optimizer, rename=renames)["step"]


class DenseTrainer:
    """The reference: the same model and batches on one process."""

    def __init__(self, dense: DenseGPT, args: argparse.Namespace) -> None:
        self.model, self.args = dense, args
        self.optimizer = torch.optim.AdamW(dense.parameters(), lr=args.lr, weight_decay=0.01)

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        loss = self.compute_gradients(inputs, target)
        self.optimizer.step()
        return loss

    def compute_gradients(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = dense_loss(self.model(inputs), target)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        return loss.item()


def differences(trainer: Trainer3D, reference: DenseGPT) -> dict[str, float]:
    """|difference| per parameter between this rank's trained parameters (gathered over the
    tensor group) and the reference's."""
    want = dict(reference.named_parameters())
    out = {}
    for name, value in trainer.gathered().items():
        expected = want["tok.weight" if name == "head.weight" else name]
        if name in ("tok.weight", "head.weight"):
            value = value[: expected.shape[0]]  # padded vocabulary rows
        out[name] = (value - expected).abs().max().item()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=None, help="default: world / (tp * pp)")
    parser.add_argument("--schedule", default="1f1b", choices=pipeline.schedule_names())
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel stages")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per data rank and step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="divisible by --tp")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4, help="divisible by --tp")
    parser.add_argument("--ffn", type=int, default=64, help="divisible by --tp")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.5, help="max gradient norm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with a one-process run")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--checkpoint", default="checkpoints/gpt_3d", help="checkpoint directory")
    parser.add_argument(
        "--resume", action="store_true", help="continue from --checkpoint if it exists"
    )
    parser.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        help="kill rank 1 during this step, on the first launch only (to try --resume under "
        "torchrun --max-restarts)",
    )
    return parser.parse_args(argv)


def progress(step: int, steps: int, loss: float, tokens_per_s: float) -> str:
    done = round(20 * step / steps)
    return (
        f"[{'#' * done}{'.' * (20 - done)}] step {step}/{steps}  loss {loss:.4f}  "
        f"{tokens_per_s:,.0f} tokens/s"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = torch_mp.init(tp=args.tp, pp=args.pp, dp=args.dp, backend="gloo", timeout=60)
    rank = dist.get_rank()
    corpus = Corpus()
    torch.manual_seed(args.seed)  # the same dense model on every rank
    dense = DenseGPT(corpus.vocab, args)
    reference = DenseTrainer(copy.deepcopy(dense), args) if args.check else None
    trainer = Trainer3D(dense, mesh, args, corpus.vocab)
    if rank == 0:
        print(
            f"GPT, {args.layers} layers of hidden size {args.hidden}, vocabulary {corpus.vocab}: "
            f"tp={mesh.tp_size} x pp={mesh.pp_size} x dp={mesh.dp_size} ranks, schedule "
            f"{args.schedule}, sequence parallel {'on' if args.sequence_parallel else 'off'}, "
            f"{'DistributedDataParallel' if args.ddp else 'torch_mp.DataParallel'}",
            flush=True,
        )
    global_batch = args.batch * mesh.dp_size
    worst_loss = 0.0
    first = 1
    if args.resume and os.path.isdir(args.checkpoint):
        first = trainer.load(args.checkpoint) + 1
        if reference is not None:  # the one-process run replays the steps it missed
            for step in range(1, first):
                reference.step(*corpus.batch(step, global_batch, args.seq))
        if rank == 0:
            print(f"resumed from {args.checkpoint} after step {first - 1}", flush=True)
    start = time.perf_counter()
    for step in range(first, args.steps + 1):
        inputs, target = corpus.batch(step, global_batch, args.seq)
        mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
        first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == args.fail_at_step and first_launch and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as a machine failure would
        loss = trainer.step(inputs[mine], target[mine])
        tokens_per_s = global_batch * args.seq * (step - first + 1) / (time.perf_counter() - start)
        line = progress(step, args.steps, loss, tokens_per_s)
        if reference is not None:
            expected = reference.step(inputs, target)
            worst_loss = max(worst_loss, abs(loss - expected))
            line += f"  (one process: {expected:.4f})"
        if rank == 0:
            print(line, flush=True)
        if args.save_every and step % args.save_every == 0:
            trainer.save(args.checkpoint, step)
    if reference is None:
        dist.destroy_process_group()
        return 0
    worst_param = max(differences(trainer, reference.model).values())
    worst = torch.tensor([worst_loss, worst_param], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst_loss, worst_param = worst.tolist()
    ok = worst_loss <= LOSS_TOLERANCE and worst_param <= PARAMETER_TOLERANCE
    if rank == 0:
        print(
            f"agreement with the one-process reference: losses max |diff| {worst_loss:.2e} "
            f"(tolerance {LOSS_TOLERANCE:.0e}), parameters max |diff| {worst_param:.2e} "
            f"(tolerance {PARAMETER_TOLERANCE:.0e}): {'OK' if ok else 'MISMATCH'}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
