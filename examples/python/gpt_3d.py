"""Trains a small GPT on data x pipeline x tensor parallel ranks ("3D"), and with ``--check``
compares it with the same model trained on one process.

The model is torch_mp.models.gpt's (token and learned position embeddings, pre-LN transformer
layers under a causal mask, a final LayerNorm and an output head tied to the token embedding),
initialised as GPT-2 is and trained byte by byte on Shakespeare's plays (shipped with the
package) with AdamW (warm-up, then cosine decay) and gradient clipping
(torch_mp.models.gpt_training). At the end it prints a sample of text from the trained model;
``--plot loss.png`` draws the loss curve (and the one-process run's, with ``--check``) and
``--trace timeline.png`` the pipeline's timeline measured in the last step.

- Tensor parallelism (``--tp``): the vocabulary (embedding rows, logits, loss), the attention
  heads and the MLP are split across the tensor group; ``--sequence-parallel`` also splits the
  LayerNorms and residuals along the sequence.
- Pipeline parallelism (``--pp``, ``--schedule``): the layers are cut into stages; the first holds
  the embeddings, the last the final norm and the head. The head is a copy of the embedding tied
  to it across the pipeline (its gradient summed with the embedding's after every step).
- Data parallelism (``--dp``): every replica sees its own share of each batch; each stage is
  wrapped in ``torch_mp.DataParallel`` (or, with ``--ddp``, PyTorch's DistributedDataParallel)
  and the gradients are averaged once per step. ``--zero`` shards AdamW's state over the data
  ranks (``torch_mp.DistributedOptimizer``, ZeRO-1), ``--zero 2`` the gradients too
  (``DataParallel(shard_gradients=True)``, ZeRO-2; the head's tie to the embedding sums the
  tied copies' pieces), ``--zero 3`` the parameters too (``DataParallel(shard_parameters=True)``,
  each transformer layer gathered for its forward and its backward; at pp 1 for now).
- ``--bf16``: bf16 parameters and compute, fp32 main gradients and fp32 masters (ZeRO-2); the
  reference runs the same recipe on one process, and ``--check`` holds it to bf16's roundings.
- Context parallelism (``--cp``): each sequence is split over a context group of ranks, each
  holding its load-balanced part (two chunks of ``s / (2 cp)``) from the embeddings to the loss;
  only attention meets the other parts, by ``--cp-method`` (ring by default). The loss is the mean
  over the whole sequence, and the gradients are averaged over data x context ranks.
- Experts (``--moe-experts E``, ``--ep N``): every layer's MLP is a mixture of E experts (top
  ``--moe-top-k``), spread over expert groups of N data ranks (``torch_mp.moe.MoE``: tokens go to
  their experts' ranks by all-to-all and come back the same way). The layers' load-balancing
  losses ride with the activations through the stages into the loss; ``torch_mp.DataParallel``
  reduces the experts' gradients over the ranks holding the same experts. The one-process
  reference takes each data rank's micro-batch as its own piece, since a load-balancing loss is
  that of the tokens it is computed on.
- Activation recomputation (``--recompute full|selective``): each layer keeps only its input
  and runs again in the backward, or recomputes its attention core only, with the same dropout
  masks: the same gradients, less activation memory.

- Checkpoints (``--save-every N --checkpoint DIR``, ``--resume``): model and AdamW state in the
  dense model's names (torch_mp.checkpoint), so a run saved at one layout resumes at another;
  saved in the background (``checkpoint.async_save``: a snapshot, then written while the next
  steps run), each block with its checksum.

Run on CPU with Gloo (tp * pp * dp processes; the times are those of 2 CPU cores). A short
form first, 5 steps (about 25 s), then the whole 70 steps (about 70 s)::

    torchrun --standalone --nproc-per-node=8 examples/python/gpt_3d.py \\
        --tp 2 --pp 2 --dp 2 --schedule 1f1b --check --steps 5
    torchrun --standalone --nproc-per-node=8 examples/python/gpt_3d.py \\
        --tp 2 --pp 2 --dp 2 --schedule 1f1b --check

With experts, 5 steps (about 39 s; its 70 steps take over 5 minutes)::

    torchrun --standalone --nproc-per-node=8 examples/python/gpt_3d.py \\
        --pp 2 --dp 4 --moe-experts 8 --ep 2 --check --steps 5

Killed and relaunched, it continues from its last checkpoint (``--fail-at-step`` kills rank 1
once, to try it, when the last checkpoint is on disk; about 16 s)::

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

import torch_mp
from torch_mp import pipeline
from torch_mp.models import (
    Corpus,
    DenseGPT,
    DenseTrainer,
    GPTConfig,
    Trainer3D,
    TrainingOptions,
    differences,
    sample,
)

# Losses agree to fp32 rounding of sums taken in other orders. Parameters after AdamW agree less
# tightly: AdamW moves every element by lr * m / sqrt(v), so an element inherits the *relative*
# error of its own gradient, which is large for the few entries whose gradient is tiny next to
# the terms summed into it (an absolute error of 1e-9 on a gradient of 1e-6 is 1e-3 relative).
# And rounding differences compound as the model learns: two one-process runs of the demo that
# only sum the batch in another order (two halves, gradients accumulated) are 1.4e-3 apart in loss
# by step 70. So after every step, once they are compared, the reference takes the parallel
# model's parameters: every step is checked from the same start, at fp32's tolerances.
LOSS_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = 1e-4
# bf16 (--bf16; the reference runs the same recipe, the losses taken in fp32 by both): the tensor
# group's all-reduces sum bf16 partial products that one process sums inside one matrix product,
# so activations differ by bf16 roundings (2^-8 relative), and a parameter by an ulp of bf16
# where its master's rounding went the other way.
BF16_TOLERANCES = (1e-3, 1e-2)


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: this file's docstring as it is written, and every option's default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument(
        "--dp", type=int, default=None, help="data-parallel ranks (None: world / (tp * pp * cp))"
    )
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks per sequence")
    parser.add_argument(
        "--cp-method",
        default="ring",
        choices=list(torch_mp.context_parallel.METHODS),
        help="how the context ranks' attention meets the other parts",
    )
    parser.add_argument(
        "--moe-experts", type=int, default=0, help="experts per MoE layer (0: dense MLPs)"
    )
    parser.add_argument("--moe-top-k", type=int, default=2, help="experts per token")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel ranks (divides the data ranks)"
    )
    parser.add_argument(
        "--schedule", default="1f1b", choices=pipeline.schedule_names(), help="pipeline schedule"
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split the LayerNorms and residuals along the sequence",
    )
    parser.add_argument(
        "--recompute",
        choices=["full", "selective"],
        default=None,
        help="recompute each layer (full) or its attention core (selective) in the backward",
    )
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel stages")
    parser.add_argument(
        "--zero",
        type=int,
        nargs="?",
        const=1,
        default=0,
        choices=[1, 2, 3],
        help="bare or 1: shard AdamW's state over the data ranks; 2: the gradients too; "
        "3: the parameters too (pp 1)",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 with fp32 main gradients and masters (ZeRO-2)"
    )
    parser.add_argument("--steps", type=int, default=70, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="sequences per data rank and step")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    parser.add_argument(
        "--seq", type=int, default=32, help="divisible by --tp and by 2 * --cp (x --tp with -sp)"
    )
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="divisible by --tp")
    parser.add_argument("--ffn", type=int, default=128, help="divisible by --tp")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
    parser.add_argument(
        "--decay-steps", type=int, default=None, help="the cosine decay's end (None: --steps)"
    )
    parser.add_argument(
        "--min-lr", type=float, default=None, help="reached at its end (None: lr / 10)"
    )
    parser.add_argument("--clip", type=float, default=0.5, help="max gradient norm")
    parser.add_argument("--seed", type=int, default=0, help="of the initial weights and the data")
    parser.add_argument("--check", action="store_true", help="compare with a one-process run")
    parser.add_argument(
        "--sample", type=int, default=200, help="bytes of text to sample at the end (0: none)"
    )
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampling")
    parser.add_argument("--plot", help="write the loss curve to this .png or .svg")
    parser.add_argument("--trace", help="write the last step's pipeline timeline to this file")
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


def config_of(args: argparse.Namespace, vocab: int) -> GPTConfig:
    return GPTConfig(
        vocab,
        args.seq,
        args.hidden,
        args.heads,
        args.ffn,
        args.layers,
        moe_experts=args.moe_experts,
        moe_top_k=args.moe_top_k,
    )


def options_of(args: argparse.Namespace) -> TrainingOptions:
    return TrainingOptions(
        schedule=args.schedule,
        microbatches=args.microbatches,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        ddp=args.ddp,
        zero=args.zero,
        bf16=args.bf16,
        lr=args.lr,
        clip=args.clip,
        warmup=args.warmup,
        decay_steps=args.steps if args.decay_steps is None else args.decay_steps,
        min_lr=args.lr / 10 if args.min_lr is None else args.min_lr,
        context_method=args.cp_method,
    )


def progress(step: int, steps: int, loss: float, tokens_per_s: float) -> str:
    done = round(20 * step / steps)
    return (
        f"[{'#' * done}{'.' * (20 - done)}] step {step}/{steps}  loss {loss:.4f}  "
        f"{tokens_per_s:,.0f} tokens/s"
    )


def plot(path: str, losses: dict[int, float], reference: dict[int, float]) -> None:
    """The loss curve of the run (and of the one-process reference) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(list(losses), list(losses.values()), label="tp x pp x dp")
    if reference:
        axes.plot(list(reference), list(reference.values()), "--", label="one process")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per byte)")
    axes.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    print(f"wrote the loss curve to {path}")


def show_sample(trainer: Trainer3D, config: GPTConfig, corpus: Corpus, args) -> None:
    """Rank 0 prints text sampled from the trained model (gathered whole onto it)."""
    state = trainer.dense_state()  # a collective
    if state is None:
        return
    model = DenseGPT(config)
    model.load_state_dict(state)
    prompt = corpus.ids[None, : config.seq // 2]
    generator = torch.Generator().manual_seed(args.seed)
    ids = sample(model, prompt, args.sample, args.temperature, generator)
    print(
        f"sampled from the trained model (temperature {args.temperature}), after the prompt "
        f"{corpus.decode(prompt[0].tolist())!r}:\n{corpus.decode(ids[0].tolist())}\n----"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = torch_mp.init(
        tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep, backend="gloo", timeout=60
    )
    rank = dist.get_rank()
    corpus = Corpus()
    torch.manual_seed(args.seed)  # the same dense model on every rank
    dense = DenseGPT(config_of(args, corpus.vocab))
    options = options_of(args)
    pieces = mesh.dp_size * args.microbatches  # (each its own load-balancing loss, with MoE)
    reference = DenseTrainer(copy.deepcopy(dense), options, pieces) if args.check else None
    trainer = Trainer3D(dense, mesh, options)
    if rank == 0:
        moe = f"MoE layers of {args.moe_experts} experts (top {args.moe_top_k}), "
        moe = moe if args.moe_experts else ""
        print(
            f"GPT, {args.layers} layers of hidden size {args.hidden}, vocabulary {corpus.vocab}: "
            f"tp={mesh.tp_size} x pp={mesh.pp_size} x dp={mesh.dp_size}"
            f"{f' x cp={mesh.cp_size} ({args.cp_method})' if mesh.cp_size > 1 else ''}"
            f"{f' x ep={mesh.ep_size}' if args.moe_experts else ''} ranks, "
            f"{moe}"
            f"schedule {args.schedule}, "
            f"sequence parallel {'on' if args.sequence_parallel else 'off'}, "
            f"{'DistributedDataParallel' if args.ddp else 'torch_mp.DataParallel'}"
            f"{', AdamW sharded over the data ranks' if args.zero or args.bf16 else ''}"
            f"{', gradients too' if args.zero >= 2 or args.bf16 else ''}"
            f"{', parameters too' if args.zero == 3 else ''}"
            f"{', bf16 with fp32 main gradients and masters' if args.bf16 else ''}"
            f"{f', recompute {args.recompute}' if args.recompute else ''}",
            flush=True,
        )
    global_batch = args.batch * mesh.dp_size
    losses: dict[int, float] = {}
    expected_losses: dict[int, float] = {}
    worst_loss = worst_param = 0.0
    first = 1
    if args.resume and os.path.isdir(args.checkpoint):
        first = trainer.load(args.checkpoint) + 1
        if reference is not None:  # the one-process run replays the steps it missed
            for step in range(1, first):
                reference.step(*corpus.batch(step, global_batch, args.seq))
            # ... and takes the resumed parameters, as at every sync (its AdamW state is its own).
            reference.load_parameters(trainer.dense_state(everywhere=True))
        if rank == 0:
            print(f"resumed from {args.checkpoint} after step {first - 1}", flush=True)
    saving, save_stalls = None, []  # the checkpoint being written, the time each save took
    start = time.perf_counter()
    for step in range(first, args.steps + 1):
        inputs, target = corpus.batch(step, global_batch, args.seq)
        mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
        first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == args.fail_at_step and first_launch:
            if saving is not None:  # (so that the relaunch resumes from a known step)
                saving.wait()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # as a machine failure would
        loss = trainer.step(inputs[mine], target[mine])
        tokens_per_s = global_batch * args.seq * (step - first + 1) / (time.perf_counter() - start)
        line = progress(step, args.steps, loss, tokens_per_s)
        losses[step] = loss
        if reference is not None:
            expected = reference.step(inputs, target)
            expected_losses[step] = expected
            worst_loss = max(worst_loss, abs(loss - expected))
            # Collectives: compare the parameters, then start the next step from the same ones.
            worst_param = max(worst_param, *differences(trainer, reference.model).values())
            if step < args.steps:
                reference.load_parameters(trainer.dense_state(everywhere=True))
            line += f"  (one process: {expected:.4f})"
        if rank == 0:
            print(line, flush=True)
        if args.save_every and step % args.save_every == 0:
            stall = time.perf_counter()
            saving = trainer.save(args.checkpoint, step, background=True)  # written meanwhile
            save_stalls.append(time.perf_counter() - stall)
    if saving is not None:
        saving.wait()
        if rank == 0:
            print(
                f"checkpoints saved in the background to {args.checkpoint}: each stalled "
                f"training for {1e3 * max(save_stalls):.1f} ms at most (the snapshot)",
                flush=True,
            )
    if args.trace:
        trace = trainer.pipe.gathered_trace()  # a collective over the pipeline group
        if rank == 0 and trace is not None:
            Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
            pipeline.render(trace, args.trace, title=f"{args.schedule}, step {args.steps} measured")
            print(f"wrote the last step's pipeline timeline to {args.trace}")
    if rank == 0 and args.plot:
        plot(args.plot, losses, expected_losses)
    if args.sample:
        show_sample(trainer, config_of(args, corpus.vocab), corpus, args)
    if reference is None:
        dist.destroy_process_group()
        return 0
    worst = torch.tensor([worst_loss, worst_param], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst_loss, worst_param = worst.tolist()
    loss_tolerance, parameter_tolerance = (
        BF16_TOLERANCES if args.bf16 else (LOSS_TOLERANCE, PARAMETER_TOLERANCE)
    )
    ok = worst_loss <= loss_tolerance and worst_param <= parameter_tolerance
    if rank == 0:
        print(
            "agreement with the one-process reference (each step from the same parameters): "
            f"losses max |diff| "
            f"{worst_loss:.2e} (tolerance {loss_tolerance:.0e}), parameters max |diff| "
            f"{worst_param:.2e} (tolerance {parameter_tolerance:.0e}): "
            f"{'OK' if ok else 'MISMATCH'}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
