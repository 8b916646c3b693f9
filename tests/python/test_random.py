"""torch_mp.random: one stream shared by the tensor-parallel ranks, one per rank inside fork."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import use_mesh

import torch_mp


def _draws() -> dict:
    group = use_mesh(dist.get_world_size()).tp_group
    torch_mp.random.manual_seed(1234)
    outside = torch.rand(4)
    with torch_mp.random.fork():
        inside = torch.rand(4)
    after = torch.rand(4)
    with torch_mp.random.fork():
        inside_again = torch.rand(4)
    # The default stream resumed exactly where fork left it.
    torch.manual_seed(1234)
    expected_outside, expected_after = torch.rand(4), torch.rand(4)
    # The per-rank stream is seed + 2718 + tp_rank, and it advanced across forks.
    g = torch.Generator().manual_seed(1234 + 2718 + dist.get_rank(group))
    expected_inside, expected_again = torch.rand(4, generator=g), torch.rand(4, generator=g)
    assert torch.equal(outside, expected_outside) and torch.equal(after, expected_after)
    assert torch.equal(inside, expected_inside) and torch.equal(inside_again, expected_again)
    return {"outside": outside, "inside": inside}


def test_outside_draws_agree_and_inside_draws_differ_across_ranks(world):
    results = world.run(_draws)
    for r in results[1:]:
        assert torch.equal(r["outside"], results[0]["outside"])
        assert not torch.equal(r["inside"], results[0]["inside"])


def _fork_restores_on_error() -> None:
    use_mesh(dist.get_world_size())
    torch_mp.random.manual_seed(7)
    with pytest.raises(ZeroDivisionError), torch_mp.random.fork():
        torch.rand(3)
        1 / 0  # noqa: B018
    after = torch.rand(2)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(2))


def test_fork_restores_the_default_stream_when_the_body_raises(world2):
    world2.run(_fork_restores_on_error)


def _unknown_stream() -> str:
    with pytest.raises(RuntimeError, match="no stream 'nope' on cpu") as error:
        with torch_mp.random.fork("nope"):
            pass
    return str(error.value)


def test_forking_into_an_unseeded_stream_raises(world2):
    world2.run(_unknown_stream)


def _dropout_in_a_parallel_region_matches_dense() -> None:
    """Dropout on the column layer's output shards inside fork, then RowParallelLinear: equal to
    the dense MLP with the same masks put together (each rank's mask from its own stream)."""
    from torch import nn

    mesh = use_mesh(dist.get_world_size())
    t = mesh.tp_size
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(5, 8)
    col = torch_mp.ColumnParallelLinear.from_dense(fc1)
    row = torch_mp.RowParallelLinear.from_dense(fc2)
    torch_mp.random.manual_seed(99)
    with torch_mp.random.fork():
        h = nn.functional.dropout(col(x), p=0.5)
    y = row(h)
    # Rebuild the dense masks from each rank's stream (CPU dropout draws bernoulli(1 - p)).
    masks = []
    for q in range(t):
        g = torch.Generator().manual_seed(99 + 2718 + q)
        masks.append(torch.empty(5, 16 // t).bernoulli_(0.5, generator=g))
    dense = fc2(fc1(x) * torch.cat(masks, 1) / 0.5)
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)
    assert h.shape == (5, 16 // t)


def test_dropout_inside_fork_uses_each_ranks_stream(world):
    world.run(_dropout_in_a_parallel_region_matches_dense)


def _region_dropout_streams() -> None:
    """Dropout on shards draws from the per-rank stream (masks differ between ranks), dropout on
    replicated tensors from the shared one (masks equal)."""
    mesh = use_mesh(dist.get_world_size())
    torch_mp.random.manual_seed(3)
    ones = torch.ones(4096)
    shard_mask = torch_mp.random.region_dropout(ones, 0.5, True)
    replicated_mask = torch.nn.functional.dropout(ones, 0.5, True)
    masks = [torch.empty_like(ones) for _ in range(mesh.tp_size)]
    dist.all_gather(masks, shard_mask)
    if mesh.tp_size > 1:
        assert not torch.equal(masks[0], masks[1]), "shards drew the same dropout mask"
    dist.all_gather(masks, replicated_mask)
    assert all(torch.equal(m, replicated_mask) for m in masks), "replicated masks differ"


def test_dropout_draws_from_the_right_stream(world):
    world.run(_region_dropout_streams)
