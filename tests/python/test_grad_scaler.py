"""torch_mp.GradScaler: fp16 parameters and compute with fp32 main gradients, fp32 masters and
dynamic loss scaling equal that recipe written out by hand on one process, skipped steps and a
grown scale included; an overflow on one rank of the mesh (one tensor shard, one data rank)
skips the step on every rank; with ZeRO-2 it unscales the gradient pieces the optimizer steps
from."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from reference import error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp

WIDTH, HIDDEN, LR = 12, 20, 1e-2
MICROBATCHES = 2


def _dense(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def _fp16_recipe_matches_hand_written() -> None:
    """fp16 parameters and compute, DataParallel(grad_dtype=float32), fp32 masters and a
    GradScaler whose first scale overflows the fp16 loss (2**17 times a loss near 1 exceeds
    65504) and that grows every 2 clean steps, against the same recipe on one process."""
    mesh = use_mesh(1)
    dp, rank = mesh.dp_size, mesh.dp_rank
    model = _dense().to(torch.float16)
    by_hand = copy.deepcopy(model)
    wrapped = torch_mp.DataParallel(model, mesh=mesh, grad_dtype=torch.float32)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, master_dtype=torch.float32, lr=LR
    )
    scaler = torch_mp.GradScaler(init_scale=2.0**17, growth_interval=2)
    masters = [p.detach().float() for p in by_hand.parameters()]
    hand_optimizer = torch.optim.AdamW(masters, lr=LR)
    hand_scale, hand_clean, skipped, grown = 2.0**17, 0, 0, 0
    for step in range(6):
        x, y = (t.to(torch.float16) for t in _batch(step, dp * MICROBATCHES))
        xs, ys = x.chunk(dp * MICROBATCHES), y.chunk(dp * MICROBATCHES)
        optimizer.zero_grad()
        for m in range(MICROBATCHES):
            mine = rank * MICROBATCHES + m
            context = wrapped.no_sync() if m < MICROBATCHES - 1 else contextlib.nullcontext()
            with context:
                loss = nn.functional.mse_loss(wrapped(xs[mine]), ys[mine]) / MICROBATCHES
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        # By hand: every rank's fp32 main gradients, averaged, unscaled, checked, stepped.
        main = [torch.zeros_like(master) for master in masters]
        for r in range(dp):
            ranks_main = [torch.zeros_like(master) for master in masters]
            for m in range(MICROBATCHES):
                by_hand.zero_grad()
                mine = r * MICROBATCHES + m
                loss = nn.functional.mse_loss(by_hand(xs[mine]), ys[mine]) / MICROBATCHES
                (loss * hand_scale).backward()
                for acc, p in zip(ranks_main, by_hand.parameters(), strict=True):
                    acc += p.grad.float()
            for total, acc in zip(main, ranks_main, strict=True):
                total += acc / dp
        inverse = torch.tensor(1.0 / hand_scale, dtype=torch.float32)
        overflow = any(not torch.isfinite(g).all() for g in main)
        assert scaler.found_inf() == overflow, f"step {step}"
        if overflow:
            hand_scale, hand_clean, skipped = hand_scale * 0.5, 0, skipped + 1
        else:
            for master, g in zip(masters, main, strict=True):
                master.grad = g * inverse
            hand_optimizer.step()
            with torch.no_grad():
                for master, p in zip(masters, by_hand.parameters(), strict=True):
                    p.copy_(master)
            hand_clean += 1
            if hand_clean == 2:
                hand_scale, hand_clean, grown = hand_scale * 2, 0, grown + 1
        scaler.update()
        assert scaler.get_scale() == hand_scale, f"step {step}"
        for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
            assert p.dtype == torch.float16
            if dp <= 2:  # (a sum of two terms has one order)
                assert torch.equal(p, q), f"step {step} {name}"
            else:
                torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-2)
    assert skipped >= 2 and grown >= 1, (skipped, grown)  # both ways were taken


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_tensor(step, 0, 4 * rows, WIDTH), rank_tensor(step + 10, 0, 4 * rows, WIDTH)


def test_fp16_with_loss_scaling_equals_the_recipe_by_hand(world):
    world.run(_fp16_recipe_matches_hand_written)


def _one_rank_overflows(shard_gradients: bool) -> None:
    """tp 2 x dp 2: an inf in one element of tp rank 1's column shard gradient, put there on dp
    rank 0 before the data-parallel reduction: it reaches tp rank 1's gradients only (both data
    ranks' under ZeRO-1, the one whose piece holds it under ZeRO-2)."""
    mesh = use_mesh(2)
    dense = _dense()
    model = nn.Sequential(
        torch_mp.ColumnParallelLinear.from_dense(dense[0]),
        nn.GELU(),
        torch_mp.RowParallelLinear.from_dense(dense[2]),
    )
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_gradients=shard_gradients)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR
    )
    scaler = torch_mp.GradScaler(init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    hooks = []
    if mesh.tp_rank == 1 and mesh.dp_rank == 0:
        inf = float("inf")
        hooks.append(
            model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), inf))
        )
    x, y = _batch(0, 1)
    optimizer.zero_grad()
    scaler.scale(nn.functional.mse_loss(wrapped(x), y)).backward()
    scaler.unscale_(optimizer)
    torch_mp.clip_grad_norm_(model.parameters(), 1.0, mesh=mesh)
    assert scaler.step(optimizer) is None
    assert scaler.found_inf()
    scaler.update()
    assert scaler.get_scale() == 2.0
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q), dist.get_rank()
    # The next, clean step steps everywhere.
    for hook in hooks:
        hook.remove()
    optimizer.zero_grad()
    scaler.scale(nn.functional.mse_loss(wrapped(_batch(1, 1)[0]), _batch(1, 1)[1])).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("shard_gradients", [False, True], ids=["zero1", "zero2"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(world4, shard_gradients):
    world4.run(_one_rank_overflows, shard_gradients)


def _misuse() -> list[str | None]:
    use_mesh(1)
    model = _dense()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch_mp.GradScaler()
    model(torch.ones(2, WIDTH)).sum().backward()
    scaler.unscale_(optimizer)
    twice = error_of(scaler.unscale_, optimizer)
    scaler.update()
    state = scaler.state_dict()
    other = torch_mp.GradScaler(init_scale=1.0)
    other.load_state_dict(state)
    assert other.get_scale() == scaler.get_scale() == 2.0**16
    off = torch_mp.GradScaler(enabled=False)
    assert off.scale(torch.tensor(3.0)).item() == 3.0 and off.get_scale() == 1.0
    return [twice, error_of(torch_mp.GradScaler, growth_factor=0.5), error_of(scaler.update)]


def test_misuse_is_refused_and_the_state_round_trips(world2):
    for twice, growth, update in world2.run(_misuse):
        assert "already called" in twice
        assert "growth_factor must be above 1" in growth
        assert "without unscale_" in update


def _disagreeing_scales() -> str | None:
    use_mesh(1)
    return error_of(torch_mp.GradScaler, init_scale=2.0 ** (10 + dist.get_rank()))


def test_ranks_with_different_options_are_refused_on_every_rank(world2):
    for message in world2.run(_disagreeing_scales):
        assert message is not None and "torch_mp.GradScaler options" in message, message
