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
