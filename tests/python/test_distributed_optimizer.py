"""torch_mp.DistributedOptimizer (ZeRO-1): each step equals plain AdamW's on the same layout
bit for bit, and the one-process model's; its state is 1/dp of a plain optimizer's; its state
dict is a plain optimizer's; checkpoints saved at one data-parallel size load at another; fp32
masters of bf16 parameters equal the recipe written out by hand."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp
from torch_mp import checkpoint, pipeline

WIDTH = 12
HIDDEN = 20
LR = 1e-2
MAX_NORM = 0.05  # small enough that every step clips


def _dense(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH), nn.LayerNorm(WIDTH)
    )


def _sharded(dense: nn.Sequential) -> nn.Sequential:
    """The tensor-parallel model of ``dense`` (this rank's shards of its current values)."""
    return nn.Sequential(
        torch_mp.ColumnParallelLinear.from_dense(dense[0]),
        nn.GELU(),
        torch_mp.RowParallelLinear.from_dense(dense[2]),
        copy.deepcopy(dense[3]),
    )


def _adamw(params, **kwargs):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **kwargs)


def _zero(model: nn.Module, mesh, **kwargs) -> torch_mp.DistributedOptimizer:
    return torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR, weight_decay=0.1, **kwargs
    )


def _batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_tensor(step, 0, 4 * dp, WIDTH), rank_tensor(step + 10, 0, 4 * dp, WIDTH)


def _dense_step(model, optimizer, step: int, dp: int) -> None:
    x, y = _batch(step, dp)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()


def _parallel_step(wrapped, optimizer, step: int, mesh) -> None:
    x, y = _batch(step, mesh.dp_size)
    optimizer.zero_grad()
    mine = slice(4 * mesh.dp_rank, 4 * (mesh.dp_rank + 1))
    nn.functional.mse_loss(wrapped(x[mine]), y[mine]).backward()
    torch_mp.clip_grad_norm_(wrapped.parameters(), MAX_NORM, mesh=mesh)
    optimizer.step()


def _state_elements(optimizer) -> int:
    return sum(
        v.numel()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _data_parallel(module: nn.Module, mesh, zero: int, **kwargs) -> torch_mp.DataParallel:
    """``module`` wrapped for ZeRO stage ``zero``: 1 plain DataParallel (DDP's buckets, for the
    all-reduce to sum in the plain run's order), 2 sharded gradients, 3 sharded parameters."""
    if zero == 1:
        return torch_mp.DataParallel(module, mesh=mesh)
    return torch_mp.DataParallel(
        module, mesh=mesh, shard_gradients=True, shard_parameters=zero == 3, **kwargs
    )


def _steps_match_adamw(tp: int, bucket_cap_mb: float, zero: int = 1) -> None:
    mesh = use_mesh(tp)
    dense = _dense()
    reference = copy.deepcopy(dense)
    plain, sharded = _sharded(dense), _sharded(dense)
    wrapped = [
        torch_mp.DataParallel(plain, mesh=mesh),
        _data_parallel(sharded, mesh, zero, bucket_cap_mb=bucket_cap_mb),
    ]
    optimizers = [
        _adamw(reference.parameters()),
        _adamw(plain.parameters()),
        _zero(sharded, mesh, bucket_cap_mb=bucket_cap_mb),
    ]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in optimizers]
    # With sharded gradients, the clipping norm sums the pieces' squares rather than whole
    # tensors' norms (its factor may differ in the last bit), and a reduce-scatter of more than
    # two ranks sums in another order than an all-reduce: equal to the tolerance only.
    exact = zero == 1
    for step in range(3):
        _dense_step(reference, optimizers[0], step, mesh.dp_size)
        for model, optimizer in zip(wrapped, optimizers[1:], strict=True):
            _parallel_step(model, optimizer, step, mesh)
        for scheduler in schedulers:
            scheduler.step()
        expected = _sharded(reference).parameters()
        with wrapped[1].gathered_parameters():
            for (name, p), q, ref in zip(
                sharded.named_parameters(), plain.parameters(), expected, strict=True
            ):
                if exact:
                    assert torch.equal(p, q), f"step {step} {name}: not plain AdamW's here"
                assert_close(p, q, f"step {step} {name} against plain AdamW on this layout")
                assert_close(p, ref, f"step {step} {name} against one process")
        if zero > 1:
            assert all(p.grad is None for p in sharded.parameters()), "gradients kept whole"
        if zero == 3:
            held = sum(p.numel() for p in sharded.parameters())
            assert held == 0, f"step {step}: {held} parameter elements held whole"
    assert optimizers[2].param_groups[0]["lr"] == optimizers[1].param_groups[0]["lr"]
    # This rank's state: its 1/dp of the elements, plus at most the padding of every bucket.
    mine, whole = _state_elements(optimizers[2]), _state_elements(optimizers[1])
    total = torch.tensor(mine)
    dist.all_reduce(total, group=mesh.dp_group)
    assert total.item() == whole, (total.item(), whole)
    buckets = optimizers[2]._shards.num_buckets
    assert mine <= whole / mesh.dp_size + 2 * mesh.dp_size * buckets, (mine, whole)


_ZERO = {"zero1": 1, "zero2": 2, "zero3": 3}


@pytest.mark.parametrize("zero", list(_ZERO))
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 4e-4])  # one bucket; a bucket per ~100 elements
def test_steps_equal_adamw_at_every_data_parallel_size(bucket_cap_mb, zero, world):
    world.run(_steps_match_adamw, 1, bucket_cap_mb, _ZERO[zero])


@pytest.mark.parametrize("zero", list(_ZERO))
def test_steps_equal_adamw_with_tensor_parallelism(zero, world4):
    world4.run(_steps_match_adamw, 2, 4e-4, _ZERO[zero])  # tp 2 x dp 2


def _pipeline_of_sharded_stages(schedule: str, zero: int) -> None:
    """pp 2 x dp 2: each stage in DataParallel(shard_gradients=True), or with its parameters
    sharded too (ZeRO-3), with a DistributedOptimizer; AdamW steps equal the one-process
    model's."""
    mesh = use_mesh(1, pp=2)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh()), nn.Linear(HIDDEN, WIDTH)]
    reference = copy.deepcopy(nn.Sequential(*stages))
    reference_optimizer = _adamw(reference.parameters())
    mine = stages[mesh.pp_rank]
    wrapped = _data_parallel(mine, mesh, zero, bucket_cap_mb=4e-4)
    optimizer = _zero(mine, mesh)
    m = 2
    pipe = pipeline.Pipeline(wrapped, schedule, m, loss_fn=nn.functional.mse_loss, mesh=mesh)
    for step in range(3):
        x, y = _batch(step, 2 * m)  # 4 rows per micro-batch and data rank
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        reference_optimizer.step()
        optimizer.zero_grad()
        shard = slice(mesh.dp_rank * 4 * m, (mesh.dp_rank + 1) * 4 * m)
        first, last = mesh.pp_rank == 0, mesh.pp_rank == 1
        pipe.step(x[shard] if first else None, target=y[shard] if last else None)
        torch_mp.clip_grad_norm_(mine.parameters(), MAX_NORM, mesh=mesh)
        optimizer.step()
        with wrapped.gathered_parameters():
            for (name, p), ref in zip(
                mine.named_parameters(), reference[mesh.pp_rank].parameters(), strict=True
            ):
                assert_close(p, ref, f"{schedule} step {step} stage {mesh.pp_rank} {name}")


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_stages_with_sharded_gradients_equal_one_process(schedule, zero, world4):
    world4.run(_pipeline_of_sharded_stages, schedule, _ZERO[zero])


def _state_dict_is_a_plain_optimizers() -> None:
    mesh = use_mesh(1)
    plain, sharded = _sharded(_dense()), _sharded(_dense())
    wrapped = [torch_mp.DataParallel(m, mesh=mesh) for m in (plain, sharded)]
    optimizers = [_adamw(plain.parameters()), _zero(sharded, mesh, bucket_cap_mb=4e-4)]
    for step in range(2):
        for model, optimizer in zip(wrapped, optimizers, strict=True):
            _parallel_step(model, optimizer, step, mesh)
    saved = [o.state_dict() for o in optimizers]
    assert saved[0]["param_groups"] == saved[1]["param_groups"]
    assert saved[0]["state"].keys() == saved[1]["state"].keys()
    for index, state in saved[0]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved[1]["state"][index][key]), (index, key)
    # The plain optimizer's state dict into a fresh DistributedOptimizer, and the other way.
    restored = _zero(sharded, mesh)
    restored.load_state_dict(saved[0])
    plain_again = _adamw(plain.parameters())
    plain_again.load_state_dict(restored.state_dict())
    for model, optimizer in zip(wrapped, [plain_again, restored], strict=True):
        _parallel_step(model, optimizer, 2, mesh)
    for p, q in zip(sharded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_is_a_plain_optimizers(world):
    world.run(_state_dict_is_a_plain_optimizers)


class _OneBatch:
    """A mesh as _parallel_step sees it, every data rank given the whole one-process batch: the
    averaged gradients are then exactly the one process's (g + g = 2g, halved)."""

    def __init__(self, mesh) -> None:
        self._mesh = mesh
        self.dp_size, self.dp_rank = 1, 0

    def __getattr__(self, name):
        return getattr(self._mesh, name)


def _train_and_save(path: str) -> None:
    mesh = use_mesh(1)
    model = _dense()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = _zero(model, mesh, bucket_cap_mb=4e-4)
    for step in range(2):
        _parallel_step(wrapped, optimizer, step, _OneBatch(mesh))
    checkpoint.save(path, model, optimizer, mesh=mesh)


def _load_and_step(path: str, sharded: bool) -> None:
    """Loads at this world's data-parallel size and takes the third step, which must equal the
    uninterrupted one-process run's bit for bit."""
    mesh = use_mesh(1)
    reference = _dense()
    reference_optimizer = _adamw(reference.parameters())
    for step in range(3):
        _parallel_step(reference, reference_optimizer, step, _OneBatch(mesh))
    model = _dense(seed=1)  # other values: the load must replace them
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = _zero(model, mesh) if sharded else _adamw(model.parameters())
    checkpoint.load(path, model, optimizer, mesh=mesh)
    _parallel_step(wrapped, optimizer, 2, _OneBatch(mesh))
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, ref), f"{name} after the step that follows the load"


@pytest.mark.parametrize(
    "world_size,sharded", [(4, True), (1, True), (1, False)], ids=["dp4", "dp1", "dp1-AdamW"]
)
def test_checkpoint_saved_at_dp2_loads_at_another_dp(world_size, sharded, world2, tmp_path):
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    world2.run(_train_and_save, path)
    get_world(world_size).run(_load_and_step, path, sharded)


def _bf16_masters_match_hand_written() -> None:
    mesh = use_mesh(1)
    model = _dense().to(torch.bfloat16)
    by_hand = copy.deepcopy(model)
    wrapped = torch_mp.DataParallel(model, mesh=mesh)  # (the same gradient on every rank)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, master_dtype=torch.float32, lr=LR
    )
    masters = [p.detach().float() for p in by_hand.parameters()]
    hand_optimizer = torch.optim.AdamW(masters, lr=LR)
    for step in range(3):
        x, y = (t.to(torch.bfloat16) for t in _batch(step, 1))  # the same on every rank
        for m in (wrapped, by_hand):
            m.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        optimizer.step()
        for master, p in zip(masters, by_hand.parameters(), strict=True):
            master.grad = p.grad.float()
        hand_optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, by_hand.parameters(), strict=True):
                p.copy_(master)  # rounded to bf16
        for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, q), f"step {step} {name}"
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_fp32_masters_of_bf16_parameters_equal_the_recipe_by_hand(world):
    world.run(_bf16_masters_match_hand_written)


MICROBATCHES = 2


def _bf16_recipe_matches_hand_written() -> None:
    """bf16 parameters and compute, DataParallel(grad_dtype=float32) (each micro-batch's bf16
    gradients added into fp32 main gradients, averaged in fp32) and fp32 masters, against the
    same recipe written out on one process."""
    mesh = use_mesh(1)
    dp, rank = mesh.dp_size, mesh.dp_rank
    model = _dense().to(torch.bfloat16)
    by_hand = copy.deepcopy(model)
    wrapped = torch_mp.DataParallel(model, mesh=mesh, grad_dtype=torch.float32)
    optimizer = _zero(model, mesh, master_dtype=torch.float32)
    masters = [p.detach().float() for p in by_hand.parameters()]
    hand_optimizer = _adamw(masters)
    for step in range(3):
        x, y = (t.to(torch.bfloat16) for t in _batch(step, dp * MICROBATCHES))
        xs, ys = x.chunk(dp * MICROBATCHES), y.chunk(dp * MICROBATCHES)
        optimizer.zero_grad()
        for m in range(MICROBATCHES):  # this rank's micro-batches, the last one synced
            mine = rank * MICROBATCHES + m
            context = wrapped.no_sync() if m < MICROBATCHES - 1 else contextlib.nullcontext()
            with context:
                loss = nn.functional.mse_loss(wrapped(xs[mine]), ys[mine]) / MICROBATCHES
            loss.backward()
        optimizer.step()
        main = [torch.zeros_like(master) for master in masters]
        for r in range(dp):  # by hand: every rank's main gradients, then their average
            ranks_main = [torch.zeros_like(master) for master in masters]
            for m in range(MICROBATCHES):
                by_hand.zero_grad()
                mine = r * MICROBATCHES + m
                (nn.functional.mse_loss(by_hand(xs[mine]), ys[mine]) / MICROBATCHES).backward()
                for acc, p in zip(ranks_main, by_hand.parameters(), strict=True):
                    acc += p.grad.float()
            for total, acc in zip(main, ranks_main, strict=True):
                total += acc / dp
        for master, g in zip(masters, main, strict=True):
            master.grad = g
        hand_optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, by_hand.parameters(), strict=True):
                p.copy_(master)
        for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
            assert p.dtype == torch.bfloat16
            if dp <= 2:  # (a sum of two terms has one order)
                assert torch.equal(p, q), f"step {step} {name}"
            else:
                torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-2)


def test_bf16_with_fp32_main_gradients_and_masters_equals_the_recipe_by_hand(world):
    world.run(_bf16_recipe_matches_hand_written)


def _plain_optimizer_over_sharded_gradients() -> str | None:
    mesh = use_mesh(1)
    model = _dense()
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_gradients=True)
    optimizer = _adamw(model.parameters())
    nn.functional.mse_loss(wrapped(_batch(0, 1)[0]), _batch(0, 1)[1]).backward()
    return error_of(optimizer.step)


def test_a_plain_optimizer_over_sharded_gradients_raises(world2):
    for message in world2.run(_plain_optimizer_over_sharded_gradients):
        assert message is not None and "DistributedOptimizer" in message


def _optimizer_made_before_the_sharding_wrapper() -> str | None:
    mesh = use_mesh(1)
    model = _dense()
    optimizer = _zero(model, mesh)
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_gradients=True)
    nn.functional.mse_loss(wrapped(_batch(0, 1)[0]), _batch(0, 1)[1]).backward()
    return error_of(optimizer.step)


def test_an_optimizer_made_before_its_sharding_wrapper_raises(world2):
    for message in world2.run(_optimizer_made_before_the_sharding_wrapper):
        assert message is not None and "build the optimizer after wrapping" in message


def _unused_parameter_is_named() -> str | None:
    mesh = use_mesh(1)
    model = nn.ModuleDict({"used": nn.Linear(WIDTH, WIDTH), "unused": nn.Linear(WIDTH, 3)})
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_gradients=True)
    optimizer = _zero(model, mesh)
    wrapped.prepare_for_forward()
    out = model["used"](_batch(0, 1)[0])
    wrapped.prepare_for_backward()
    out.sum().backward()
    return error_of(optimizer.step)


def test_a_parameter_without_gradient_in_a_sharded_step_is_named(world2):
    for message in world2.run(_unused_parameter_is_named):
        assert message is not None and "gave no gradient to 2 parameters" in message


def _mismatched_parameters() -> str | None:
    mesh = use_mesh(1)
    layer = nn.Linear(WIDTH + dist.get_rank(), WIDTH)  # rank 1's has another shape
    return error_of(torch_mp.DistributedOptimizer, layer.parameters(), torch.optim.AdamW, mesh=mesh)


def test_parameters_that_differ_across_data_ranks_raise_on_every_rank(world2):
    for message in world2.run(_mismatched_parameters):
        assert message is not None and "DistributedOptimizer" in message


def _group_added_later() -> str | None:
    mesh = use_mesh(1)
    optimizer = _zero(_dense(), mesh)
    return error_of(optimizer.add_param_group, {"params": [nn.Parameter(torch.zeros(3))]})


def test_adding_a_parameter_group_later_is_refused(world2):
    for message in world2.run(_group_added_later):
        assert message is not None and "cannot be added after construction" in message


def _non_contiguous_parameter() -> str | None:
    mesh = use_mesh(1)
    weight = nn.Parameter(torch.randn(WIDTH, HIDDEN).t())
    return error_of(torch_mp.DistributedOptimizer, [weight], torch.optim.AdamW, mesh=mesh)


def test_a_non_contiguous_parameter_is_refused(world2):
    for message in world2.run(_non_contiguous_parameter):
        assert message is not None and "not contiguous" in message
