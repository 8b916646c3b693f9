"""Training the GPT of :mod:`torch_mp.models.gpt`: on data x pipeline x tensor (x context)
parallel ranks (:class:`Trainer3D`) and, as the reference it is checked against, on one process
(:class:`DenseTrainer`), with the same AdamW and gradient clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp import _C, checkpoint, pipeline
from torch_mp.models.gpt import DenseGPT, build_stages, dense_loss

__all__ = ["DenseTrainer", "Trainer3D", "TrainingOptions", "differences", "learning_rate"]


@dataclass(frozen=True)
class TrainingOptions:
    """How the GPT is trained: the pipeline schedule and micro-batches, sequence parallelism,
    the layers' activation recomputation (``recompute``: None, ``"full"`` or ``"selective"``),
    DistributedDataParallel (``ddp``) or torch_mp.DataParallel stages, ZeRO (``zero``: 0 none;
    1 AdamW's state sharded over the data ranks, torch_mp.DistributedOptimizer; 2 the gradients
    too, ``DataParallel(shard_gradients=True)``; 3 the parameters too,
    ``DataParallel(shard_parameters=True)``, each transformer layer a unit, at pp = 1), bf16
    parameters and compute with fp32 main gradients and fp32 masters (``bf16``, which implies
    ZeRO-2 or more), AdamW's learning rate (its
    schedule: :func:`learning_rate`) and weight decay, and the gradient norm clipped to. The
    context parallelism comes from the mesh (``cp``), its attention by ``context_method``
    (:func:`torch_mp.context_parallel.attention`)."""

    schedule: str = "1f1b"
    microbatches: int = 4
    sequence_parallel: bool = False
    recompute: str | None = None
    ddp: bool = False
    zero: int = 0
    bf16: bool = False
    lr: float = 3e-3
    weight_decay: float = 0.01
    clip: float = 0.5
    warmup: int = 0
    decay_steps: int = 0
    min_lr: float = 0.0
    context_method: str = "ring"


def learning_rate(options: TrainingOptions, step: int) -> float:
    """The learning rate of step ``step`` (from 1): rising linearly to ``lr`` over the first
    ``warmup`` steps, then falling to ``min_lr`` along a half cosine that ends at step
    ``decay_steps`` (and staying there); ``lr`` throughout when ``decay_steps`` is 0. (The C++
    example's schedule, csrc/torch_mp/models/gpt_training.h, is the same.)"""
    if step <= options.warmup:
        return options.lr * step / options.warmup
    if options.decay_steps <= 0:
        return options.lr
    done = min(1.0, (step - options.warmup) / max(1, options.decay_steps - options.warmup))
    return options.min_lr + 0.5 * (options.lr - options.min_lr) * (1.0 + math.cos(math.pi * done))


def _optimizer_step(optimizer: torch.optim.Optimizer, options: TrainingOptions, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(options, step)
    optimizer.step()


class Trainer3D:
    """The GPT's stages on this rank, wrapped for data parallelism and driven by a Pipeline."""

    def __init__(self, dense: DenseGPT, mesh: torch_mp.Mesh, options: TrainingOptions) -> None:
        self.mesh, self.options = mesh, options
        stages_per_rank = torch_mp.pipeline.default_stages_per_rank(options.schedule)
        self.stages = build_stages(
            dense,
            mesh,
            stages_per_rank,
            options.sequence_parallel,
            options.recompute,
            options.context_method,
        )
        zero = max(2, int(options.zero)) if options.bf16 else int(options.zero)
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"TrainingOptions: zero must be 0, 1, 2 or 3, got {options.zero}")
        if options.ddp and dense.config.moe_experts and mesh.ep_size > 1:
            raise ValueError(
                "TrainingOptions: DistributedDataParallel stages would average different "
                "experts' gradients over the data group (ep > 1); use torch_mp.DataParallel"
            )
        if zero == 3 and mesh.pp_size > 1:
            raise ValueError(
                "TrainingOptions: ZeRO-3 (zero=3) at pp > 1 is not supported yet: the head's "
                "tie to the embedding sums whole gradients across the pipeline, which ZeRO-3 "
                "has already reduce-scattered; use zero=2 or pp=1"
            )
        if zero >= 2 and len(self.stages) > 1:
            raise ValueError(
                f"TrainingOptions: ZeRO-{zero} with two stages on a rank ({options.schedule}): "
                "each stage is its own DataParallel, which one DistributedOptimizer cannot "
                "span; use zero=1 or a schedule of one stage per rank"
            )
        if options.ddp and zero >= 2:
            raise ValueError(
                "TrainingOptions: ZeRO-2 and -3 (zero=2, 3 or bf16) need torch_mp.DataParallel"
            )
        if options.bf16:
            for stage in self.stages:
                stage.to(torch.bfloat16)
        if options.ddp:
            wrapped = [
                DistributedDataParallel(s, process_group=mesh.dp_cp_group) for s in self.stages
            ]
        else:
            grad_dtype = torch.float32 if options.bf16 else None
            wrapped = [
                torch_mp.DataParallel(
                    s,
                    mesh=mesh,
                    shard_gradients=zero >= 2,
                    grad_dtype=grad_dtype,
                    shard_parameters=zero == 3,
                    # (the ends, whose head reads the embedding outside its forward, gathered
                    # with the stage)
                    unit=torch_mp.ParallelTransformerLayer if zero == 3 else None,
                )
                for s in self.stages
            ]
        tied = [s.tok.weight for s in self.stages if s.first and not s.last]
        tied += [s.head.weight for s in self.stages if s.last and not s.first]
        self.pipe = pipeline.Pipeline(
            wrapped,
            options.schedule,
            options.microbatches,
            loss_fn=self.stages[-1].loss,
            mesh=mesh,
            tied_parameters=tied,
        )
        self.parameters = [p for s in self.stages for p in s.parameters()]
        hyperparameters = {"lr": options.lr, "weight_decay": options.weight_decay}
        if zero:
            master_dtype = torch.float32 if options.bf16 else None
            self.optimizer = torch_mp.DistributedOptimizer(
                self.parameters,
                torch.optim.AdamW,
                mesh=mesh,
                master_dtype=master_dtype,
                **hyperparameters,
            )
        else:
            self.optimizer = torch.optim.AdamW(self.parameters, **hyperparameters)
        self.holds_first = self.stages[0].first
        self.holds_last = self.stages[-1].last
        self.steps_done = 0

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        """One optimizer step on this data rank's share of the batch, at the learning rate of
        the schedule; returns the loss of the whole batch (mean over the data ranks), the same
        on every rank."""
        loss = self.compute_gradients(inputs, target)
        self.steps_done += 1
        _optimizer_step(self.optimizer, self.options, self.steps_done)
        return loss

    def compute_gradients(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        """The step without the optimizer: gradients averaged over the data (x context) ranks,
        tied copies summed, clipped over the mesh."""
        self.optimizer.zero_grad()
        loss = self.pipe.step(
            inputs if self.holds_first else None, target=target if self.holds_last else None
        )
        torch_mp.clip_grad_norm_(self.parameters, self.options.clip, mesh=self.mesh)
        # Share the last stage's loss: counted once per data rank (tensor and context rank 0;
        # the context ranks' losses are the same mean over their sequences), averaged.
        counted = loss is not None and self.mesh.tp_rank == 0 and self.mesh.cp_rank == 0
        world = dist.group.WORLD.group_name
        value = torch.tensor(
            [loss.item() if counted else 0.0], dtype=torch.float64, device=_C.device_of(world)
        )
        return torch.ops.torch_mp.all_reduce(value, "sum", world).item() / self.mesh.dp_size

    def gathered(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters in ``DenseGPT``'s names (a tensor-group collective)."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            out.update(stage.gathered())
        return out

    def dense_state(self, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters in ``DenseGPT``'s names on global rank 0 (None
        elsewhere), or on every rank with ``everywhere``: a collective over every rank (the
        core's ``all_gather_named``: each stage's tensors from its first tensor, data and
        context rank)."""
        mine = self.gathered()  # a tensor-group collective: every rank takes part
        if self.mesh.tp_rank != 0 or self.mesh.dp_rank != 0 or self.mesh.cp_rank != 0:
            mine = {}
        mine.pop("head.weight", None)  # tied to tok.weight
        whole = _C.all_gather_named(mine, dist.group.WORLD.group_name)
        return whole if everywhere or dist.get_rank() == 0 else None

    def save(self, path: str, step: int, *, background: bool = False):
        """Saves the model and the optimizer in DenseGPT's names (every rank): loadable at
        any other tp x pp x dp, from Python or C++. With ``background``, from a snapshot
        while training goes on (:func:`torch_mp.checkpoint.async_save`): returns its handle
        at once (``wait()`` for it)."""
        renames = [stage.dense_names() for stage in self.stages]
        save = checkpoint.async_save if background else checkpoint.save
        return save(
            path, self.stages, self.optimizer, {"step": step}, rename=renames, mesh=self.mesh
        )

    def load(self, path: str) -> int:
        """Loads a checkpoint saved at any layout; returns the step it was saved after."""
        renames = [stage.dense_names() for stage in self.stages]
        extra = checkpoint.load(path, self.stages, self.optimizer, rename=renames, mesh=self.mesh)
        self.steps_done = int(extra["step"])
        return self.steps_done


class DenseTrainer:
    """The reference: the same model and batches on one process; with ``options.bf16`` the
    same recipe written out: a bf16 model, its gradients in fp32, AdamW on fp32 masters written
    back rounded.

    A model with MoE layers takes each batch in ``chunks`` equal pieces, in order, as the data
    ranks' micro-batches (``dp * microbatches``): the loss is the mean over the pieces of each
    one's cross-entropy plus its layers' load-balancing losses (which, unlike a mean, do not
    add up over pieces: each piece's is that of its own tokens, as each rank computes it)."""

    def __init__(self, dense: DenseGPT, options: TrainingOptions, chunks: int = 1) -> None:
        self.model, self.options, self.chunks = dense, options, chunks
        if options.bf16:
            self.model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float() for p in self.params] if options.bf16 else self.params
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=options.lr, weight_decay=options.weight_decay
        )
        self.steps_done = 0

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        loss = self.compute_gradients(inputs, target)
        self.steps_done += 1
        _optimizer_step(self.optimizer, self.options, self.steps_done)
        if self.options.bf16:
            with torch.no_grad():
                for master, p in zip(self.masters, self.params, strict=True):
                    p.copy_(master)
        return loss

    def compute_gradients(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        self.model.zero_grad()
        if self.model.config.moe_experts:
            loss = 0.0
            for part, part_target in zip(
                inputs.chunk(self.chunks), target.chunk(self.chunks), strict=True
            ):
                logits, aux_loss = self.model(part, with_aux_loss=True)
                part_loss = (dense_loss(logits, part_target) + aux_loss) / self.chunks
                part_loss.backward()
                loss += part_loss.item()
        else:
            loss = dense_loss(self.model(inputs), target)
            loss.backward()
            loss = loss.item()
        if self.options.bf16:
            for master, p in zip(self.masters, self.params, strict=True):
                master.grad = p.grad.float()
        nn.utils.clip_grad_norm_(self.masters, self.options.clip)
        return loss

    def load_parameters(self, state: dict[str, torch.Tensor]) -> None:
        """Takes ``state`` (DenseGPT's names) as its parameters, and its masters from them."""
        self.model.load_state_dict(state)
        if self.options.bf16:
            with torch.no_grad():
                for master, p in zip(self.masters, self.params, strict=True):
                    master.copy_(p)


def differences(trainer: Trainer3D, reference: DenseGPT) -> dict[str, float]:
    """|difference| per parameter between this rank's trained parameters (gathered over the
    tensor group) and the reference's."""
    want = dict(reference.named_parameters())
    return {
        name: (value.float() - want["tok.weight" if name == "head.weight" else name].float())
        .abs()
        .max()
        .item()
        for name, value in trainer.gathered().items()
    }
