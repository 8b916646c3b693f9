"""The GPT of examples/python/gpt_3d.py trained on tp x pp x dp ranks equals the same model
trained on one process: for 5 AdamW steps with clipping, every schedule, sequence parallelism on
and off, DistributedDataParallel and torch_mp.DataParallel stages.

Tolerances (fp32): the first step's clipped gradients and every step's loss at rtol 1e-5 /
atol 1e-6 (sums taken in another order); parameters after 5 AdamW steps at atol 1e-4, because
AdamW scales each element's update by 1 / sqrt(v): an element inherits the *relative* error of
its own gradient, which is large for the few entries whose gradient is tiny next to the terms
summed into it (see gpt_3d.PARAMETER_TOLERANCE).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, use_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))
import gpt_3d  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8", "--batch", "4"]


def _gradients(trainer: gpt_3d.Trainer3D) -> dict[str, torch.Tensor]:
    """The stages' gradients gathered into the dense model's names (a collective)."""
    params = trainer.parameters
    for p in params:  # gathered() reads values: show it the gradients
        p.data, p.grad = p.grad, p.data
    try:
        return {name: value.detach().clone() for name, value in trainer.gathered().items()}
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def _train_3d(tp: int, pp: int, schedule: str, sequence_parallel: bool, ddp: bool) -> None:
    flags = ["--tp", str(tp), "--pp", str(pp), "--schedule", schedule, "--microbatches", "2"]
    flags += ["--sequence-parallel"] * sequence_parallel + ["--ddp"] * ddp
    args = gpt_3d.parse_args(SMALL + flags)
    mesh = use_mesh(tp, pp)
    corpus = gpt_3d.Corpus()
    torch.manual_seed(0)
    model = gpt_3d.DenseGPT(corpus.vocab, args)
    reference = gpt_3d.DenseTrainer(gpt_3d.copy.deepcopy(model), args)
    trainer = gpt_3d.Trainer3D(model, mesh, args, corpus.vocab)
    mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
    for step in range(1, 6):
        inputs, target = corpus.batch(step, args.batch * mesh.dp_size, args.seq)
        loss = trainer.compute_gradients(inputs[mine], target[mine])
        expected = reference.compute_gradients(inputs, target)
        assert_close(torch.tensor(loss), torch.tensor(expected), f"step {step} loss")
        if step == 1:
            want = {n: p.grad for n, p in reference.model.named_parameters()}
            for name, grad in _gradients(trainer).items():
                ref = want["tok.weight" if name == "head.weight" else name]
                assert_close(grad[: ref.shape[0]], ref, f"{name} gradient")
        trainer.optimizer.step()
        reference.optimizer.step()
    worst = gpt_3d.differences(trainer, reference.model)
    name = max(worst, key=worst.get)
    assert worst[name] <= gpt_3d.PARAMETER_TOLERANCE, (dist.get_rank(), name, worst[name])


@pytest.mark.parametrize("ddp", [False, True], ids=["DataParallel", "DDP"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_2x2x2_equals_one_process(schedule, sequence_parallel, ddp, world8):
    world8.run(_train_3d, 2, 2, schedule, sequence_parallel, ddp)


@pytest.mark.parametrize("ddp", [False, True], ids=["DataParallel", "DDP"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_1x2x2_equals_one_process(schedule, ddp, world4):
    world4.run(_train_3d, 1, 2, schedule, False, ddp)


# ---- Checkpoints across layouts -------------------------------------------------------------

GLOBAL_BATCH = 8


def _trainer(tp: int, pp: int, seed: int):
    """A GPT trainer at (tp, pp) with dp = world / (tp pp), each data rank's batch such that the
    global batch is the same at every layout."""
    mesh = use_mesh(tp, pp)
    batch = GLOBAL_BATCH // mesh.dp_size
    args = gpt_3d.parse_args(
        ["--hidden", "16", "--heads", "4", "--ffn", "32", "--seq", "8", "--batch", str(batch)]
        + ["--tp", str(tp), "--pp", str(pp), "--microbatches", str(min(2, batch))]
    )
    corpus = gpt_3d.Corpus()
    torch.manual_seed(seed)
    model = gpt_3d.DenseGPT(corpus.vocab, args)
    return gpt_3d.Trainer3D(model, mesh, args, corpus.vocab), args, corpus, mesh


def _train_and_save(tp: int, pp: int, path: str) -> None:
    trainer, args, corpus, mesh = _trainer(tp, pp, seed=0)
    inputs, target = corpus.batch(1, GLOBAL_BATCH, args.seq)
    mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
    trainer.step(inputs[mine], target[mine])
    trainer.save(path, step=1)


def _load_and_continue(tp: int, pp: int, path: str) -> tuple[float, float, float]:
    """Loads at (tp, pp) a model of other values, takes step 2; returns its loss, the
    uninterrupted one-process run's, and the worst parameter difference after it."""
    trainer, args, corpus, mesh = _trainer(tp, pp, seed=1)
    step = trainer.load(path)
    assert step == 1
    torch.manual_seed(0)
    reference = gpt_3d.DenseTrainer(gpt_3d.DenseGPT(corpus.vocab, args), args)
    reference.step(*corpus.batch(1, GLOBAL_BATCH, args.seq))
    inputs, target = corpus.batch(2, GLOBAL_BATCH, args.seq)
    mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
    loss = trainer.step(inputs[mine], target[mine])
    expected = reference.step(inputs, target)
    return loss, expected, max(gpt_3d.differences(trainer, reference.model).values())


@pytest.mark.parametrize(
    "tp,pp,world_size", [(2, 2, 8), (4, 1, 8), (1, 4, 8), (2, 2, 4), (1, 1, 1)]
)
def test_saved_at_2x2x2_the_next_step_at_any_layout_equals_the_uninterrupted_run(
    tp, pp, world_size, world8, tmp_path
):
    # Saved after one AdamW step at (tp, pp, dp) = (2, 2, 2); loaded at (tp, pp, dp) =
    # (2, 2, 2), (4, 1, 2), (1, 4, 2), (2, 2, 1) and (1, 1, 1). Tolerances as for training.
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    world8.run(_train_and_save, 2, 2, path)
    for loss, expected, worst in get_world(world_size).run(_load_and_continue, tp, pp, path):
        assert abs(loss - expected) <= 1e-5 * abs(expected) + 1e-6, (loss, expected)
        assert worst <= gpt_3d.PARAMETER_TOLERANCE, worst
