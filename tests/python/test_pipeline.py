"""The pipeline executor on real multi-process Gloo groups: every schedule's loss and every
parameter gradient equal the one-process model's, with the loss averaged over the batch."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

from torch_mp import functional, pipeline

WIDTH = 8


def _model(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)  # the same model on every rank
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)]


def _step_matches_reference(
    name: str,
    stages_per_rank: int,
    microbatches_per_rank: int,
    steps: int = 1,
    nccl_rules: bool = False,
) -> None:
    """One or more training steps against the one-process model. With `nccl_rules`, the
    pipeline is built with the collective checks on (so it runs under NCCL's rules, which its
    schedule is proved to keep), and an evaluation step is checked too."""
    p, rank = dist.get_world_size(), dist.get_rank()
    mesh = use_mesh(1, pp=p)
    stages = _model(p * stages_per_rank)
    reference = copy.deepcopy(nn.Sequential(*stages))
    m = microbatches_per_rank * p
    x, y = rank_tensor(1, 0, 2 * m, WIDTH), rank_tensor(2, 0, 2 * m, WIDTH)
    expected_loss = nn.functional.mse_loss(reference(x), y)
    expected_loss.backward()

    schedule = pipeline.schedule(name, p * stages_per_rank, m, stages_per_rank)
    indices = schedule.stages_of_rank(rank)
    mine = [stages[i] for i in indices]
    first, last = 0 in indices, len(stages) - 1 in indices  # zbv: rank 0 holds both
    functional.set_check_collectives(nccl_rules)
    try:
        pipe = pipeline.Pipeline(mine, schedule, loss_fn=nn.functional.mse_loss, mesh=mesh)
    finally:
        functional.set_check_collectives(False)
    assert pipe.ordered == nccl_rules
    if nccl_rules:
        pipeline.simulate(pipe.schedule, comm_semantics="nccl")  # what it runs is NCCL-safe
    # Ranks without the first stage pass None (or nothing at all, as the other tests do).
    for _ in range(steps):  # gradients accumulate over steps, as in the reference's
        loss = pipe.step(x if first else None, target=y if last else None)
    if steps > 1:
        for param in reference.parameters():
            param.grad *= steps

    if last:
        assert_close(loss, expected_loss.detach(), "loss")
    else:
        assert loss is None
    for index, stage in zip(indices, mine, strict=True):
        for (name_, param), ref in zip(
            stage.named_parameters(), reference[index].parameters(), strict=True
        ):
            assert_close(param.grad, ref.grad, f"stage {index} {name_} gradient")
    if nccl_rules:  # evaluation's forward-only lists, made NCCL-safe too
        out = pipe.eval_step(x if first else None)
        if last:
            with torch.no_grad():
                assert_close(out, reference(x), "eval output")


@pytest.mark.parametrize(
    "name,stages_per_rank",
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("zb_h1", 1),
        ("interleaved_zb", 2),
        ("zbv", 2),
    ],
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_step_matches_one_process_reference(name, stages_per_rank, world_size, request):
    world = request.getfixturevalue(f"world{world_size}")
    world.run(_step_matches_reference, name, stages_per_rank, 2)


def _nccl_safe_interleaved_matches_reference() -> None:
    p, rank = dist.get_world_size(), dist.get_rank()
    mesh = use_mesh(1, pp=p)
    stages = _model(2 * p)
    reference = copy.deepcopy(nn.Sequential(*stages))
    m = 2 * p
    x, y = rank_tensor(1, 0, 2 * m, WIDTH), rank_tensor(2, 0, 2 * m, WIDTH)
    nn.functional.mse_loss(reference(x), y).backward()
    schedule = pipeline.make_nccl_safe(pipeline.schedule("interleaved_1f1b", 2 * p, m, 2))
    pipe = pipeline.Pipeline(stages[rank::p], schedule, loss_fn=nn.functional.mse_loss, mesh=mesh)
    pipe.step(x if rank == 0 else None, target=y if rank == p - 1 else None)
    for index, stage in zip(range(rank, 2 * p, p), stages[rank::p], strict=True):
        for param, ref in zip(stage.parameters(), reference[index].parameters(), strict=True):
            assert_close(param.grad, ref.grad, f"stage {index} gradient")


def test_the_nccl_safe_order_runs_exactly(world2):
    world2.run(_nccl_safe_interleaved_matches_reference)


@pytest.mark.parametrize("name,stages_per_rank", [("1f1b", 1), ("zb_h1", 1), ("zbv", 2)])
def test_gradients_accumulate_over_steps(name, stages_per_rank, world2):
    world2.run(_step_matches_reference, name, stages_per_rank, 2, 2)


class _Split(nn.Module):
    """Returns two tensors: the next stage receives both."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x)), x * 2


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, skip):
        return self.linear(h + skip)


def _two_tensors_between_stages() -> None:
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    torch.manual_seed(0)
    stages = [_Split(), _Join()]
    reference = copy.deepcopy(stages)
    x, y = rank_tensor(3, 0, 8, WIDTH), rank_tensor(4, 0, 8, WIDTH)
    nn.functional.mse_loss(reference[1](*reference[0](x)), y).backward()
    pipe = pipeline.Pipeline(stages[rank], "1f1b", 4, loss_fn=nn.functional.mse_loss, mesh=mesh)
    pipe.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
    for param, ref in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True):
        assert_close(param.grad, ref.grad, "gradient")


def test_several_tensors_pass_between_stages(world2):
    world2.run(_two_tensors_between_stages)


class _WithPositions(nn.Module):
    """Passes an integer tensor beside the activations (one message, two dtypes)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, positions=None):
        if self.first:
            positions = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, 3)
            return torch.tanh(self.linear(x)), positions
        return self.linear(x) * positions[:, :1].to(x.dtype)


def _shapes_that_change_between_steps() -> None:
    # Channels remember the last layout; a new batch size must still arrive whole and exact,
    # in training and in evaluation, for every schedule's message pattern.
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    torch.manual_seed(0)
    stages = [_WithPositions(True), _WithPositions(False)]
    reference = copy.deepcopy(stages)
    pipe = pipeline.Pipeline(stages[rank], "zb_h1", 2, loss_fn=nn.functional.mse_loss, mesh=mesh)
    for seed, rows in [(7, 8), (8, 8), (9, 12), (10, 4)]:
        x, y = rank_tensor(seed, 0, rows, WIDTH), rank_tensor(seed + 1, 0, rows, WIDTH)
        for module in (*stages, *reference):
            module.zero_grad()
        loss = sum(
            nn.functional.mse_loss(reference[1](*reference[0](xm)), ym)
            for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True)
        )
        (loss / 2).backward()
        got = pipe.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
        if rank == 1:
            assert_close(got, loss.detach() / 2, f"loss, {rows} rows")
        for param, ref in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True):
            assert_close(param.grad, ref.grad, f"gradient, {rows} rows")
        out = pipe.eval_step(*([x[: rows // 2]] if rank == 0 else []))
        if rank == 1:
            with torch.no_grad():
                expected = torch.cat(
                    [reference[1](*reference[0](xm)) for xm in x[: rows // 2].chunk(2)]
                )
            assert_close(out, expected, f"eval output, {rows // 2} rows")


def test_shapes_and_dtypes_that_change_between_steps_arrive_exactly(world2):
    world2.run(_shapes_that_change_between_steps)


def _eval_step() -> None:
    p, rank = dist.get_world_size(), dist.get_rank()
    mesh = use_mesh(1, pp=p)
    stages = _model(p)
    x, y = rank_tensor(5, 0, 8, WIDTH), rank_tensor(6, 0, 8, WIDTH)
    with torch.no_grad():
        expected = nn.Sequential(*stages)(x)
    pipe = pipeline.Pipeline(stages[rank], "1f1b", 4, loss_fn=nn.functional.mse_loss, mesh=mesh)
    out = pipe.eval_step(*([x] if rank == 0 else []), target=y if rank == p - 1 else None)
    if rank == p - 1:
        output, loss = out
        assert_close(output, expected, "eval output")
        assert_close(loss, nn.functional.mse_loss(expected, y), "eval loss")
        assert all(param.grad is None for param in stages[rank].parameters())
    else:
        assert out is None


def test_eval_step_runs_forward_only(world2):
    world2.run(_eval_step)


def _wrong_shape() -> str | None:
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    # Stage 0 emits WIDTH features, stage 1 expects 2 * WIDTH.
    stage = nn.Linear(WIDTH, WIDTH) if rank == 0 else nn.Linear(2 * WIDTH, WIDTH)
    pipe = pipeline.Pipeline(stage, "1f1b", 2, loss_fn=nn.functional.mse_loss, group=group)
    x, y = torch.ones(4, WIDTH), torch.ones(4, WIDTH)
    return error_of(pipe.step, *([x] if rank == 0 else []), target=y if rank == 1 else None)


def test_a_stage_that_emits_the_wrong_shape_is_reported_not_hung(world2):
    sender, receiver = world2.run(_wrong_shape)
    assert (
        "stage 1 (rank 1) failed on micro-batch 0 in F(1,0) given [Float[2, 8]] "
        "from stage 0 (rank 0)"
    ) in receiver
    assert sender is not None  # the sender stops at the group's timeout instead of hanging


def _bad_construction() -> list[str | None]:
    mesh = use_mesh(1, pp=2)
    stage = nn.Linear(WIDTH, WIDTH)
    return [
        error_of(pipeline.Pipeline, [stage, stage], pipeline.schedule("1f1b", 2, 4), mesh=mesh),
        error_of(pipeline.Pipeline, stage, "1f1b", 2 + dist.get_rank(), mesh=mesh),
    ]


def test_a_schedule_that_does_not_fit_or_differs_between_ranks_raises(world2):
    for stages_mismatch, schedule_mismatch in world2.run(_bad_construction):
        assert "was given 2 stage module(s), but the schedule puts 1 stage(s) on each rank" in (
            stages_mismatch
        )
        assert "must be the same on every rank" in schedule_mismatch
        # The message quotes every rank's schedule in the user's words.
        assert "rank 0: schedule 1f1b (num_stages=2, num_microbatches=2" in schedule_mismatch
        assert "rank 1: schedule 1f1b (num_stages=2, num_microbatches=3" in schedule_mismatch


def _different_schedules() -> str | None:
    mesh = use_mesh(1, pp=2)
    name = "gpipe" if dist.get_rank() == 0 else "zb_h1"
    return error_of(pipeline.Pipeline, nn.Linear(WIDTH, WIDTH), name, 2, mesh=mesh)


def test_schedules_that_differ_between_ranks_are_named(world2):
    for message in world2.run(_different_schedules):
        assert "rank 0: schedule gpipe" in message and "rank 1: schedule zb_h1" in message


def _trace(tmp: str) -> int:
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    stages = _model(2)
    pipe = pipeline.Pipeline(stages[rank], "1f1b", 2, loss_fn=nn.functional.mse_loss, mesh=mesh)
    x = torch.ones(4, WIDTH)
    pipe.step(*([x] if rank == 0 else []), target=x if rank == 1 else None)
    pipeline.chrome_trace(pipe.trace, f"{tmp}/rank{rank}.json")
    pipeline.render(pipe.trace, f"{tmp}/rank{rank}.svg")
    return len(pipe.trace.timeline)


def test_the_measured_trace_renders(world2, tmp_path):
    counts = world2.run(_trace, str(tmp_path))
    assert counts == [len(a) for a in pipeline.schedule("1f1b", 2, 2).actions]
    assert (tmp_path / "rank1.svg").exists() and (tmp_path / "rank0.json").exists()


class _FailsAt(nn.Module):
    """Runs ``module`` but raises on its ``fail_at``-th forward call (counting from 0)."""

    def __init__(self, module: nn.Module, fail_at: int) -> None:
        super().__init__()
        self.module, self.fail_at, self.calls = module, fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("injected failure")
        return self.module(x)


def _stale_messages_are_never_taken() -> None:
    rank = dist.get_rank()
    mesh = use_mesh(1, pp=2)
    stages = _model(2)
    reference = copy.deepcopy(nn.Sequential(*stages))
    m = 4
    # Stage 0 fails on micro-batch 3 after sending 0..2; stage 1 fails on micro-batch 1, so
    # micro-batch 2's message stays unreceived.
    failing = _FailsAt(stages[rank], fail_at=3 if rank == 0 else 1)
    first = pipeline.Pipeline(failing, "gpipe", m, loss_fn=nn.functional.mse_loss, mesh=mesh)
    other = rank_tensor(9, 0, 2 * m, WIDTH)  # other data: a stale message would show
    message = error_of(first.step, other if rank == 0 else None, target=other)
    assert message is not None and "injected failure" in message
    for param in stages[rank].parameters():
        param.grad = None
    x, y = rank_tensor(1, 0, 2 * m, WIDTH), rank_tensor(2, 0, 2 * m, WIDTH)
    expected = nn.functional.mse_loss(reference(x), y)
    expected.backward()
    second = pipeline.Pipeline(stages[rank], "gpipe", m, loss_fn=nn.functional.mse_loss, mesh=mesh)
    loss = second.step(x if rank == 0 else None, target=y if rank == 1 else None)
    if rank == 1:
        assert_close(loss, expected.detach(), "loss after a failed step")
    for param, ref in zip(stages[rank].parameters(), reference[rank].parameters(), strict=True):
        assert_close(param.grad, ref.grad, "gradient after a failed step")


def test_a_new_pipeline_never_takes_a_failed_steps_messages(world2):
    world2.run(_stale_messages_are_never_taken)


class _NanAt(nn.Module):
    """A Linear whose output turns NaN on its ``at``-th call."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.linear, self.at, self.calls = nn.Linear(WIDTH, WIDTH), at, 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out * float("nan") if self.calls - 1 == self.at else out


def _check_finite() -> str | None:
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    stage = _NanAt(2) if rank == 0 else nn.Linear(WIDTH, WIDTH)
    pipe = pipeline.Pipeline(
        stage, "1f1b", 4, loss_fn=nn.functional.mse_loss, group=group, check_finite=True
    )
    x = torch.ones(8, WIDTH)
    return error_of(pipe.step, x if rank == 0 else None, target=x if rank == 1 else None)


def test_check_finite_names_the_first_non_finite_tensor(world2):
    first, second = world2.run(_check_finite)
    assert "non-finite values in stage 0's output 0 (Float[2, 8]) of micro-batch 2" in first
    assert "F(0,2) on rank 0: 16 NaN and 0 infinite entries" in first
    assert second is not None  # the peer stops at its timeout, not hangs
