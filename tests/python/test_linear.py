"""ColumnParallelLinear and RowParallelLinear against the dense nn.Linear on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp

IN, HIDDEN, OUT, BATCH = 8, 16, 12, 5


def _mlp_matches_dense(gather_output: bool, bias: bool) -> None:
    """Column -> GELU -> Row built with from_dense equals the dense MLP: outputs, input
    gradients and every parameter gradient (against the matching chunk of the dense one)."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(IN, HIDDEN, bias=bias), nn.Linear(HIDDEN, OUT, bias=bias)
    x, g = rank_tensor(1, 0, BATCH, IN), rank_tensor(2, 0, BATCH, OUT)  # same on every rank

    # Dense reference on this process alone.
    x_ref = x.clone().requires_grad_()
    y_ref = fc2(nn.functional.gelu(fc1(x_ref)))
    y_ref.backward(g)

    col = torch_mp.ColumnParallelLinear.from_dense(fc1, gather_output=gather_output)
    row = torch_mp.RowParallelLinear.from_dense(fc2, input_is_parallel=not gather_output)
    x_par = x.clone().requires_grad_()
    y = row(nn.functional.gelu(col(x_par)))
    y.backward(g)

    assert_close(y, y_ref, "output")
    assert_close(x_par.grad, x_ref.grad, "input gradient")
    assert_close(col.weight.grad, fc1.weight.grad.chunk(t, 0)[r], "column weight gradient")
    assert_close(row.weight.grad, fc2.weight.grad.chunk(t, 1)[r], "row weight gradient")
    if bias:
        assert_close(col.bias.grad, fc1.bias.grad.chunk(t, 0)[r], "column bias gradient")
        assert_close(row.bias.grad, fc2.bias.grad, "row bias gradient")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("gather_output", [False, True], ids=["split", "gathered"])
def test_mlp_matches_dense(world, gather_output, bias):
    world.run(_mlp_matches_dense, gather_output, bias)


def _shards_are_chunks_of_dense() -> None:
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(0)
    dense = nn.Linear(IN, HIDDEN)
    col = torch_mp.ColumnParallelLinear.from_dense(dense)
    row = torch_mp.RowParallelLinear.from_dense(nn.Linear(HIDDEN, IN))
    assert torch.equal(col.weight, dense.weight.chunk(t, 0)[r])
    assert torch.equal(col.bias, dense.bias.chunk(t, 0)[r])
    assert col.weight.shape == (HIDDEN // t, IN) and row.weight.shape == (IN, HIDDEN // t)
    assert row.bias.shape == (IN,)


def test_shards_are_chunks_of_the_dense_weight(world):
    world.run(_shards_are_chunks_of_dense)


def _default_init_equals_seeded_nn_linear() -> None:
    use_mesh(dist.get_world_size())
    for cls in (torch_mp.ColumnParallelLinear, torch_mp.RowParallelLinear):
        torch.manual_seed(7)
        layer = cls(IN, HIDDEN)
        torch.manual_seed(7)
        dense = nn.Linear(IN, HIDDEN)
        gathered = layer.to_dense()
        assert torch.equal(gathered.weight, dense.weight), cls.__name__
        assert torch.equal(gathered.bias, dense.bias), cls.__name__


def test_default_init_equals_nn_linear_under_the_same_seed(world):
    world.run(_default_init_equals_seeded_nn_linear)


def _to_dense_round_trip() -> None:
    use_mesh(dist.get_world_size())
    torch.manual_seed(3)
    for cls in (torch_mp.ColumnParallelLinear, torch_mp.RowParallelLinear):
        dense = nn.Linear(IN, HIDDEN)
        back = cls.from_dense(dense).to_dense()
        assert isinstance(back, nn.Linear)
        assert torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)


def test_to_dense_returns_the_dense_layer_on_every_rank(world):
    world.run(_to_dense_round_trip)


def _from_dense_leaves_the_generator_alone() -> None:
    use_mesh(dist.get_world_size())
    dense = nn.Linear(IN, HIDDEN)
    torch.manual_seed(5)
    torch_mp.ColumnParallelLinear.from_dense(dense)
    torch_mp.RowParallelLinear.from_dense(nn.Linear(HIDDEN, IN))
    after_sharding = torch.rand(3)
    torch.manual_seed(5)
    nn.Linear(HIDDEN, IN)  # the dense layer above drew; sharding must not draw more
    assert torch.equal(after_sharding, torch.rand(3))


def test_from_dense_draws_no_random_numbers(world):
    world.run(_from_dense_leaves_the_generator_alone)


def _indivisible_sizes() -> list[str | None]:
    use_mesh(dist.get_world_size())
    return [
        error_of(torch_mp.ColumnParallelLinear, 8, 6),
        error_of(torch_mp.RowParallelLinear, 6, 8),
    ]


def test_sizes_not_divisible_by_the_group_raise_at_construction(world4):
    for column, row in world4.run(_indivisible_sizes):
        assert "out_features (6) must be divisible by the tensor-parallel size (4)" in column
        assert "in_features (6) must be divisible by the tensor-parallel size (4)" in row


def _config_differs_between_ranks() -> str | None:
    use_mesh(dist.get_world_size())
    return error_of(torch_mp.ColumnParallelLinear, 8, 8 * (1 + dist.get_rank()))


def test_a_config_that_differs_between_ranks_raises_on_every_rank(world2):
    for message in world2.run(_config_differs_between_ranks):
        assert "must be the same on every rank" in message
        # Only the option that differs is named, with every rank's value.
        assert "out_features (here " in message and "by rank [8, 16])" in message
        assert "in_features" not in message


def _group_disagrees_with_shard() -> list[str | None]:
    mesh = use_mesh(dist.get_world_size() // 2, pp=2)  # tp groups of 2
    col = torch_mp.ColumnParallelLinear(8, 8)
    row = torch_mp.RowParallelLinear(8, 8)
    col.group = row.group = dist.group.WORLD  # 4 ranks, but the shards were cut for 2
    assert mesh.tp_size == 2
    x = torch.ones(2, 8)
    return [error_of(col, x), error_of(row, torch.ones(2, 4))]


def test_a_group_whose_size_disagrees_with_the_shard_raises(world4):
    for column, row in world4.run(_group_disagrees_with_shard):
        assert "group of size 4" in column and "built for a different group size" in column
        assert "group of size 4" in row


def _sequence_parallel_options() -> list[str | None]:
    use_mesh(dist.get_world_size())
    return [
        error_of(torch_mp.ColumnParallelLinear, 8, 8, gather_output=True, sequence_parallel=True),
        error_of(torch_mp.RowParallelLinear, 8, 8, input_is_parallel=False, sequence_parallel=True),
    ]


def test_contradictory_sequence_parallel_options_raise(world2):
    for column, row in world2.run(_sequence_parallel_options):
        assert "gather_output and sequence_parallel" in column
        assert "sequence_parallel needs input_is_parallel" in row


def _sequence_parallel_mlp_matches_dense() -> None:
    """[s, b, h] input split along the sequence: Column(SP) -> GELU -> Row(SP) equals the dense
    MLP on this rank's rows, input and every parameter gradient included (the replicated row
    bias too: each rank adds it to its own rows only)."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    seq, batch = 4 * t, 3
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
    x, g = rank_tensor(1, 0, seq, batch, IN), rank_tensor(2, 0, seq, batch, OUT)
    x_ref = x.clone().requires_grad_()
    fc2(nn.functional.gelu(fc1(x_ref))).backward(g)

    col = torch_mp.ColumnParallelLinear.from_dense(fc1, sequence_parallel=True)
    row = torch_mp.RowParallelLinear.from_dense(fc2, sequence_parallel=True)
    x_mine = x.chunk(t, 0)[r].clone().requires_grad_()
    y = row(nn.functional.gelu(col(x_mine)))
    y.backward(g.chunk(t, 0)[r])

    with torch.no_grad():
        expected = fc2(nn.functional.gelu(fc1(x)))
    assert_close(y, expected.chunk(t, 0)[r], "output rows")
    assert_close(x_mine.grad, x_ref.grad.chunk(t, 0)[r], "input gradient rows")
    assert_close(col.weight.grad, fc1.weight.grad.chunk(t, 0)[r], "column weight gradient")
    assert_close(col.bias.grad, fc1.bias.grad.chunk(t, 0)[r], "column bias gradient")
    assert_close(row.weight.grad, fc2.weight.grad.chunk(t, 1)[r], "row weight gradient")
    assert_close(row.bias.grad, fc2.bias.grad, "row bias gradient")


def test_sequence_parallel_mlp_matches_dense(world):
    world.run(_sequence_parallel_mlp_matches_dense)


def _indivisible_on_one_rank_only() -> str | None:
    use_mesh(dist.get_world_size())
    return error_of(torch_mp.ColumnParallelLinear, 8, 6 if dist.get_rank() == 0 else 8)


def test_a_size_invalid_on_one_rank_only_raises_on_every_rank(world4):
    for message in world4.run(_indivisible_on_one_rank_only):
        assert message is not None and "must be the same on every rank" in message


def _negative_sizes() -> list[str | None]:
    use_mesh(dist.get_world_size())
    return [
        error_of(torch_mp.ColumnParallelLinear, 8, -4),
        error_of(torch_mp.RowParallelLinear, -8, 4),
        error_of(torch_mp.ColumnParallelLinear, -8, 4),
    ]


def test_negative_sizes_are_named(world2):
    for column_out, row_in, column_in in world2.run(_negative_sizes):
        assert "ColumnParallelLinear: out_features (-4) must be non-negative" in column_out
        assert "RowParallelLinear: in_features (-8) must be non-negative" in row_in
        assert "ColumnParallelLinear: in_features (-8) must be non-negative" in column_in
