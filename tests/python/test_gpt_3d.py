"""The GPT of torch_mp.models (examples/python/gpt_3d.py's) trained on tp x pp x dp ranks
equals the same model trained on one process: for 5 AdamW steps with clipping, every schedule,
sequence parallelism on and off, DistributedDataParallel and torch_mp.DataParallel stages, the
distributed optimizer and the layers' activation recomputation.

Tolerances (fp32): the first step's clipped gradients and every step's loss at rtol 1e-5 /
atol 1e-6 (sums taken in another order); parameters after 5 AdamW steps at atol 1e-4, because
AdamW scales each element's update by 1 / sqrt(v): an element inherits the *relative* error of
its own gradient, which is large for the few entries whose gradient is tiny next to the terms
summed into it (as examples/python/gpt_3d.py explains).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, use_mesh

from torch_mp.models import (
    Corpus,
    DenseGPT,
    DenseTrainer,
    GPTConfig,
    Trainer3D,
    TrainingOptions,
    differences,
)

PARAMETER_TOLERANCE = 1e-4
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
BATCH = 4


def _config(vocab: int, heads: int = 2, moe_experts: int = 0) -> GPTConfig:
    return GPTConfig(vocab, seq=8, hidden=16, heads=heads, ffn=32, moe_experts=moe_experts)


def _gradients(trainer: Trainer3D) -> dict[str, torch.Tensor]:
    """The stages' gradients gathered into the dense model's names (a collective)."""
    params = trainer.parameters
    for p in params:  # gathered() reads values: show it the gradients
        p.data, p.grad = p.grad, p.data
    try:
        return {name: value.detach().clone() for name, value in trainer.gathered().items()}
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def _train_3d(
    tp: int,
    pp: int,
    schedule: str,
    sequence_parallel: bool,
    ddp: bool,
    zero: int = 0,
    recompute: str | None = None,
    cp: int = 1,
    context_method: str = "ring",
    ep: int = 1,
    moe_experts: int = 0,
) -> None:
    options = TrainingOptions(
        schedule=schedule,
        microbatches=2,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        ddp=ddp,
        zero=zero,
        context_method=context_method,
    )
    mesh = use_mesh(tp, pp, cp, ep)
    corpus = Corpus()
    config = _config(corpus.vocab, moe_experts=moe_experts)
    torch.manual_seed(0)
    model = DenseGPT(config)
    reference = DenseTrainer(copy.deepcopy(model), options, mesh.dp_size * options.microbatches)
    trainer = Trainer3D(model, mesh, options)
    mine = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
    for step in range(1, 6):
        inputs, target = corpus.batch(step, BATCH * mesh.dp_size, config.seq)
        loss = trainer.compute_gradients(inputs[mine], target[mine])
        expected = reference.compute_gradients(inputs, target)
        assert_close(torch.tensor(loss), torch.tensor(expected), f"step {step} loss")
        if step == 1 and zero < 2:  # (ZeRO-2 and -3 leave no whole gradients to gather)
            want = {n: p.grad for n, p in reference.model.named_parameters()}
            for name, grad in _gradients(trainer).items():
                ref = want["tok.weight" if name == "head.weight" else name]
                assert_close(grad[: ref.shape[0]], ref, f"{name} gradient")
        trainer.optimizer.step()
        reference.optimizer.step()
    worst = differences(trainer, reference.model)
    name = max(worst, key=worst.get)
    assert worst[name] <= PARAMETER_TOLERANCE, (dist.get_rank(), name, worst[name])


@pytest.mark.parametrize("ddp", [False, True], ids=["DataParallel", "DDP"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_2x2x2_equals_one_process(schedule, sequence_parallel, ddp, world8):
    world8.run(_train_3d, 2, 2, schedule, sequence_parallel, ddp)


@pytest.mark.parametrize("zero", [1, 2], ids=["zero1", "zero2"])
def test_gpt_2x2x2_with_the_distributed_optimizer_equals_one_process(zero, world8):
    # (The optimizer steps after the pipeline, whatever its schedule; sharded gradients under
    # each schedule: test_distributed_optimizer.py.) ZeRO-2: the head's tie to the embedding
    # sums the two stages' gradient pieces.
    world8.run(_train_3d, 2, 2, "1f1b", False, False, zero)


def test_gpt_1x1x8_with_zero3_equals_one_process(world8):
    # Parameters sharded over 8 data ranks, each transformer layer gathered for its forward and
    # again for its backward.
    world8.run(_train_3d, 1, 1, "1f1b", False, False, 3)


def _refuses_zero_it_cannot_run() -> None:
    torch.manual_seed(0)
    dense = DenseGPT(_config(Corpus().vocab))
    with pytest.raises(ValueError, match="ZeRO-3 .* at pp > 1"):
        Trainer3D(dense, use_mesh(1, 2), TrainingOptions(zero=3))
    with pytest.raises(ValueError, match="ZeRO-2 with two stages on a rank"):
        Trainer3D(dense, use_mesh(1, 2), TrainingOptions(zero=2, schedule="interleaved_1f1b"))


def test_zero3_at_pp2_and_zero2_interleaved_are_refused(world2):
    world2.run(_refuses_zero_it_cannot_run)


@pytest.mark.parametrize(
    "schedule, recompute, sequence_parallel",
    [("zb_h1", "full", False), ("1f1b", "selective", True), ("interleaved_1f1b", "full", True)],
    ids=["zb_h1-full", "1f1b-selective-sp", "interleaved-full-sp"],
)
def test_gpt_2x2x2_with_recomputation_equals_one_process(
    schedule, recompute, sequence_parallel, world8
):
    # Under zb_h1 each layer recomputes once, in B, and W runs the recomputed graph's weight work.
    world8.run(_train_3d, 2, 2, schedule, sequence_parallel, False, False, recompute)


@pytest.mark.parametrize("ddp", [False, True], ids=["DataParallel", "DDP"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_1x2x2_equals_one_process(schedule, ddp, world4):
    world4.run(_train_3d, 1, 2, schedule, False, ddp)


@pytest.mark.parametrize(
    "tp, pp, cp, schedule, sequence_parallel, ddp, zero, method",
    [
        (1, 2, 2, "1f1b", False, False, 0, "ring"),
        (1, 2, 2, "zb_h1", False, True, 0, "all_to_all"),
        (2, 1, 2, "gpipe", True, False, 1, "all_gather"),
        (2, 2, 2, "interleaved_1f1b", True, False, 0, "ring"),
    ],
    ids=[
        "pp2-cp2-dp2-ring",
        "pp2-cp2-dp2-zb-DDP-a2a",
        "tp2-cp2-dp2-sp-zero1-all_gather",
        "tp2-pp2-cp2-sp",
    ],
)
def test_gpt_with_context_parallelism_equals_one_process(
    tp, pp, cp, schedule, sequence_parallel, ddp, zero, method, world8
):
    # Each sequence of 8 split over 2 context ranks (load-balanced chunks of 2), the loss the mean
    # over the whole sequence, the gradients averaged over data x context ranks.
    world8.run(_train_3d, tp, pp, schedule, sequence_parallel, ddp, zero, None, cp, method)


@pytest.mark.parametrize(
    "tp, pp, ep, world, schedule",
    [(1, 2, 2, 4, "1f1b"), (2, 1, 2, 8, "gpipe"), (1, 2, 2, 8, "zb_h1")],
    ids=["tp1-pp2-dp2-ep2", "tp2-pp1-dp4-ep2", "tp1-pp2-dp4-ep2-zb"],
)
def test_gpt_with_moe_layers_equals_one_process(tp, pp, ep, world, schedule):
    # Every layer's MLP a mixture of 4 experts (top 2) spread over the expert group; the
    # load-balancing losses ride with the activations through the stages into the loss. The
    # reference takes each data rank's micro-batch as its own piece (their aux losses are those
    # of their own tokens).
    from conftest import get_world

    get_world(world).run(_train_3d, tp, pp, schedule, False, False, 0, None, 1, "ring", ep, 4)


def _refuse_moe(what: str) -> str:
    mesh = use_mesh(1, 2, 1, 2)
    config = _config(Corpus().vocab, moe_experts=4)
    torch.manual_seed(0)
    options = {
        "ddp": TrainingOptions(ddp=True),
        "zero": TrainingOptions(zero=1),
        "sequence parallel": TrainingOptions(sequence_parallel=True),
    }[what]
    try:
        Trainer3D(DenseGPT(config), mesh, options)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "what, message",
    [
        ("ddp", "would average different experts' gradients"),
        ("zero", "expert parameters"),
        ("sequence parallel", "MoE layers do not support sequence parallelism"),
    ],
)
def test_gpt_with_moe_layers_refuses_what_it_cannot_do_exactly(what, message, world8):
    for error in world8.run(_refuse_moe, what):
        assert message in error, error


# ---- Checkpoints across layouts -------------------------------------------------------------

GLOBAL_BATCH = 8


def _trainer(tp: int, pp: int, seed: int, cp: int = 1, ep: int = 1, experts: int = 0):
    """A GPT trainer at (tp, pp, cp, ep) with dp = world / (tp pp cp), each data rank's batch
    such that the global batch is the same at every layout (``experts``: MoE layers)."""
    mesh = use_mesh(tp, pp, cp, ep)
    batch = GLOBAL_BATCH // mesh.dp_size
    options = TrainingOptions(microbatches=min(2, batch))
    corpus = Corpus()
    config = _config(corpus.vocab, heads=4, moe_experts=experts)
    torch.manual_seed(seed)
    trainer = Trainer3D(DenseGPT(config), mesh, options)
    return trainer, config, options, corpus, mesh, batch


def _train_and_save(tp: int, pp: int, path: str, cp: int = 1, ep: int = 1, experts: int = 0):
    trainer, config, _, corpus, mesh, batch = _trainer(tp, pp, 0, cp, ep, experts)
    inputs, target = corpus.batch(1, GLOBAL_BATCH, config.seq)
    mine = slice(mesh.dp_rank * batch, (mesh.dp_rank + 1) * batch)
    trainer.step(inputs[mine], target[mine])
    trainer.save(path, step=1)


def _load_and_continue(
    tp: int, pp: int, path: str, cp: int = 1, ep: int = 1, experts: int = 0, saved_pieces: int = 1
) -> tuple[float, float, float]:
    """Loads at (tp, pp, cp, ep) a model of other values, takes step 2; returns its loss, the
    uninterrupted one-process run's, and the worst parameter difference after it. With MoE
    layers the reference takes step 1 in the saving run's ``saved_pieces`` (data ranks x
    micro-batches) and step 2 in this run's."""
    trainer, config, options, corpus, mesh, batch = _trainer(tp, pp, 1, cp, ep, experts)
    step = trainer.load(path)
    assert step == 1
    torch.manual_seed(0)
    reference = DenseTrainer(DenseGPT(config), options, saved_pieces)
    reference.step(*corpus.batch(1, GLOBAL_BATCH, config.seq))
    reference.chunks = mesh.dp_size * options.microbatches
    inputs, target = corpus.batch(2, GLOBAL_BATCH, config.seq)
    mine = slice(mesh.dp_rank * batch, (mesh.dp_rank + 1) * batch)
    loss = trainer.step(inputs[mine], target[mine])
    expected = reference.step(inputs, target)
    return loss, expected, max(differences(trainer, reference.model).values())


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
        assert worst <= PARAMETER_TOLERANCE, worst


@pytest.mark.parametrize(
    "saved, loaded",
    [((1, 2, 2, 8), (2, 2, 1, 8)), ((2, 2, 1, 8), (1, 2, 2, 4)), ((1, 2, 2, 8), (1, 1, 4, 4))],
    ids=["cp2-to-cp1", "cp1-to-cp2", "cp2-to-cp4"],
)
def test_checkpoints_cross_context_parallel_layouts(saved, loaded, tmp_path):
    # (tp, pp, cp, world) saved and loaded: the parameters are replicated over the context
    # group, so cp does not change the format; the next step equals the uninterrupted run.
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    tp, pp, cp, world = saved
    get_world(world).run(_train_and_save, tp, pp, path, cp)
    tp, pp, cp, world = loaded
    for loss, expected, worst in get_world(world).run(_load_and_continue, tp, pp, path, cp):
        assert abs(loss - expected) <= 1e-5 * abs(expected) + 1e-6, (loss, expected)
        assert worst <= PARAMETER_TOLERANCE, worst


@pytest.mark.parametrize(
    "loaded", [(1, 1, 4, 4), (2, 1, 1, 4), (1, 2, 1, 2)], ids=["ep4", "tp2-ep1", "pp2-ep1"]
)
def test_a_gpt_with_moe_layers_saved_at_ep2_continues_at_any_ep(loaded, tmp_path):
    # Saved at (tp, pp, dp, ep) = (1, 2, 4, 2) (8 pieces of the batch: 4 data ranks x 2
    # micro-batches); loaded at (tp, pp, ep, world) = (1, 1, 4, 4), (2, 1, 1, 4), (1, 2, 1, 2):
    # the experts are stored in their dense names, so the next step equals the uninterrupted run.
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    get_world(8).run(_train_and_save, 1, 2, path, 1, 2, 4)
    tp, pp, ep, world = loaded
    results = get_world(world).run(_load_and_continue, tp, pp, path, 1, ep, 4, 8)
    for loss, expected, worst in results:
        assert abs(loss - expected) <= 1e-5 * abs(expected) + 1e-6, (loss, expected)
        assert worst <= PARAMETER_TOLERANCE, worst


def _evaluate_moe() -> tuple[float, float] | None:
    mesh = use_mesh(1, 2, 1, 2)
    config = _config(Corpus().vocab, moe_experts=4)
    torch.manual_seed(0)
    options = TrainingOptions(microbatches=2)
    model = DenseGPT(config)
    reference = DenseTrainer(copy.deepcopy(model), options, mesh.dp_size * options.microbatches)
    trainer = Trainer3D(model, mesh, options)
    inputs, target = Corpus().batch(1, BATCH * mesh.dp_size, config.seq)
    mine = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
    out = trainer.pipe.eval_step(
        inputs[mine] if trainer.holds_first else None,
        target=target[mine] if trainer.holds_last else None,
    )
    expected = reference.compute_gradients(inputs, target)  # the mean over every piece
    if out is None:
        return None
    (logits, aux_loss), loss = out
    assert aux_loss.shape == (options.microbatches,), (logits.shape, aux_loss.shape)
    value = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(value, group=mesh.dp_group)
    return value.item() / mesh.dp_size, expected


def test_a_gpt_with_moe_layers_evaluates_through_the_pipeline(world4):
    # eval_step joins the micro-batches' outputs, the load-balancing losses among them.
    for result in world4.run(_evaluate_moe):
        if result is not None:
            loss, expected = result
            assert abs(loss - expected) <= 1e-5 * abs(expected), (loss, expected)
