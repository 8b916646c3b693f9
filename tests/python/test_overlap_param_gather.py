"""DistributedOptimizer(overlap_param_gather=True): the step returns with the parameters'
all-gather still running; each bucket is waited for just before the first module that uses
it, and the steps equal the plain optimizer's on the same layout bit for bit (ZeRO-1) and one
process's (ZeRO-1 and ZeRO-2); checkpoints and explicit waits see the stepped values."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import assert_close, rank_tensor, use_mesh
from torch import nn

import torch_mp
from torch_mp import checkpoint

WIDTH = 6
LR = 1e-2
TINY_BUCKETS = 1e-6  # every parameter a bucket of its own


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def _step(wrapped, optimizer, step: int, mesh, whole: bool = False) -> None:
    x = rank_tensor(step, 0, 4 * mesh.dp_size, WIDTH)
    y = rank_tensor(step + 50, 0, 4 * mesh.dp_size, WIDTH)
    if not whole:
        x, y = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]
    optimizer.zero_grad()
    nn.functional.mse_loss(wrapped(x), y).backward()
    optimizer.step()


def _overlapped_steps_are_exact(shard_gradients: bool) -> None:
    mesh = use_mesh(1)
    reference, plain, overlapped = _mlp(), _mlp(), _mlp()
    plain_wrapped = torch_mp.DataParallel(plain, mesh=mesh, shard_gradients=shard_gradients)
    wrapped = torch_mp.DataParallel(overlapped, mesh=mesh, shard_gradients=shard_gradients)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    def zero(model, **kwargs):
        return torch_mp.DistributedOptimizer(
            model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR, **kwargs
        )

    plain_optimizer = zero(plain)
    optimizer = zero(overlapped, overlap_param_gather=True)
    for step in range(3):
        _step(reference, reference_optimizer, step, mesh, whole=True)
        _step(plain_wrapped, plain_optimizer, step, mesh)
        _step(wrapped, optimizer, step, mesh)
        optimizer.wait_for_parameters()
        for (name, p), q, r in zip(
            overlapped.named_parameters(), plain.parameters(), reference.parameters(), strict=True
        ):
            if not shard_gradients:
                assert torch.equal(p, q), f"step {step} {name}: not the plain step's"
            assert_close(p, r, f"step {step} {name} against one process")


@pytest.mark.parametrize("shard_gradients", [False, True], ids=["zero1", "zero2"])
def test_overlapped_steps_equal_the_plain_ones(shard_gradients, world):
    world.run(_overlapped_steps_are_exact, shard_gradients)


def _each_bucket_waited_for_by_its_module() -> tuple[int, int, int]:
    mesh = use_mesh(1)
    model = _mlp()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(),
        torch.optim.SGD,
        mesh=mesh,
        lr=LR,
        bucket_cap_mb=TINY_BUCKETS,
        overlap_param_gather=True,
    )
    _step(wrapped, optimizer, 0, mesh)
    after_step = optimizer._shards.pending_gathers
    model[0](torch.zeros(1, WIDTH))  # the first layer's buckets only
    after_first_layer = optimizer._shards.pending_gathers
    wrapped(torch.zeros(1, WIDTH))
    return after_step, after_first_layer, optimizer._shards.pending_gathers


def test_each_bucket_is_waited_for_just_before_its_module(world2):
    for counts in world2.run(_each_bucket_waited_for_by_its_module):
        assert counts == (4, 2, 0), counts


def _checkpoint_after_an_overlapped_step(path: str) -> None:
    mesh = use_mesh(1)
    model, expected = _mlp(), _mlp()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    expected_wrapped = torch_mp.DataParallel(expected, mesh=mesh)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR, overlap_param_gather=True
    )
    expected_optimizer = torch_mp.DistributedOptimizer(
        expected.parameters(), torch.optim.SGD, mesh=mesh, lr=LR
    )
    _step(wrapped, optimizer, 0, mesh)
    _step(expected_wrapped, expected_optimizer, 0, mesh)
    checkpoint.save(path, model, mesh=mesh)  # waits for the all-gather first
    restored = copy.deepcopy(_mlp())
    checkpoint.load(path, restored, mesh=mesh)
    for p, q in zip(restored.parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), "the checkpoint holds stale parameters"


def test_a_checkpoint_after_an_overlapped_step_holds_its_values(world2, tmp_path):
    world2.run(_checkpoint_after_an_overlapped_step, str(tmp_path / "ckpt"))


def _dropped_right_after_an_overlapped_step() -> None:
    mesh = use_mesh(1)
    model = _mlp()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR, overlap_param_gather=True
    )
    _step(wrapped, optimizer, 0, mesh)
    del optimizer, wrapped, model  # with its all-gathers still running: no wait, no hang
    torch.distributed.barrier(group=mesh.dp_group)


def test_an_optimizer_dropped_with_its_gathers_running_does_not_hang(world2):
    world2.run(_dropped_right_after_an_overlapped_step)
