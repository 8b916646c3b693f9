"""Training the GPT of :mod:`torch_mp.models.gpt`: on data x pipeline x tensor parallel ranks
(:class:`Trainer3D`) and, as the reference it is checked against, on one process
(:class:`DenseTrainer`), with the same AdamW and gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp import checkpoint, pipeline
from torch_mp.models.gpt import DenseGPT, build_stages, dense_loss

__all__ = ["DenseTrainer", "Trainer3D", "TrainingOptions", "differences"]


@dataclass(frozen=True)
class TrainingOptions:
    """How the GPT is trained: the pipeline schedule and micro-batches, sequence parallelism,
    DistributedDataParallel (``ddp``) or torch_mp.DataParallel stages, AdamW's learning rate
    and weight decay, and the gradient norm clipped to."""

    schedule: str = "1f1b"
    microbatches: int = 4
    sequence_parallel: bool = False
    ddp: bool = False
    lr: float = 3e-3
    weight_decay: float = 0.01
    clip: float = 0.5


class Trainer3D:
    """The GPT's stages on this rank, wrapped for data parallelism and driven by a Pipeline."""

    def __init__(self, dense: DenseGPT, mesh: torch_mp.Mesh, options: TrainingOptions) -> None:
        self.mesh, self.options = mesh, options
        stages_per_rank = 2 if options.schedule == "interleaved_1f1b" else 1
        self.stages = build_stages(dense, mesh, stages_per_rank, options.sequence_parallel)
        if options.ddp:
            wrapped = [DistributedDataParallel(s, process_group=mesh.dp_group) for s in self.stages]
        else:
            wrapped = [torch_mp.DataParallel(s, mesh=mesh) for s in self.stages]
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
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=options.lr, weight_decay=options.weight_decay
        )
        self.holds_first = self.stages[0].first
        self.holds_last = self.stages[-1].last

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
        torch_mp.clip_grad_norm_(self.parameters, self.options.clip, mesh=self.mesh)
        # Share the last stage's loss: counted once per data rank (tensor rank 0), averaged.
        counted = loss is not None and self.mesh.tp_rank == 0
        value = torch.tensor([loss.item() if counted else 0.0], dtype=torch.float64)
        dist.all_reduce(value)
        return value.item() / self.mesh.dp_size

    def gathered(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters in ``DenseGPT``'s names (a tensor-group collective)."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            out.update(stage.gathered())
        return out

    def save(self, path: str, step: int) -> None:
        """Saves the model and the optimizer in DenseGPT's names (every rank): loadable at
        any other tp x pp x dp, from Python or C++."""
        renames = [stage.dense_names() for stage in self.stages]
        checkpoint.save(path, self.stages, self.optimizer, {"step": step}, rename=renames)

    def load(self, path: str) -> int:
        """Loads a checkpoint saved at any layout; returns the step it was saved after."""
        renames = [stage.dense_names() for stage in self.stages]
        return int(checkpoint.load(path, self.stages, self.optimizer, rename=renames)["step"])


class DenseTrainer:
    """The reference: the same model and batches on one process."""

    def __init__(self, dense: DenseGPT, options: TrainingOptions) -> None:
        self.model, self.options = dense, options
        self.optimizer = torch.optim.AdamW(
            dense.parameters(), lr=options.lr, weight_decay=options.weight_decay
        )

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        loss = self.compute_gradients(inputs, target)
        self.optimizer.step()
        return loss

    def compute_gradients(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = dense_loss(self.model(inputs), target)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.options.clip)
        return loss.item()


def differences(trainer: Trainer3D, reference: DenseGPT) -> dict[str, float]:
    """|difference| per parameter between this rank's trained parameters (gathered over the
    tensor group) and the reference's."""
    want = dict(reference.named_parameters())
    return {
        name: (value - want["tok.weight" if name == "head.weight" else name]).abs().max().item()
        for name, value in trainer.gathered().items()
    }
