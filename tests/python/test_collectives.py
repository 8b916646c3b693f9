"""Each autograd collective on its own, forward and backward, against closed-form references
computed from every rank's inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh

import torch_mp
from torch_mp import functional as F

SHAPE = (4, 8, 12)  # divisible by 1, 2 and 4 along every dim


def _run(op: str, dim: int) -> None:
    use_mesh(dist.get_world_size())
    t, r = dist.get_world_size(), dist.get_rank()
    xs = [rank_tensor(1, q, *SHAPE) for q in range(t)]
    kwargs = {} if op in ("copy_to_tp", "reduce_from_tp") else {"dim": dim}

    x = xs[r].clone().requires_grad_()
    y = getattr(F, op)(x, **kwargs)
    grads = [rank_tensor(2, q, *y.shape) for q in range(t)]  # the gradient reaching y, per rank
    y.backward(grads[r])

    def chunk(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(t, dim)[r]

    expected_y, expected_grad = {
        "copy_to_tp": lambda: (xs[r], sum(grads)),
        "reduce_from_tp": lambda: (sum(xs), grads[r]),
        "scatter_to_tp": lambda: (chunk(xs[r]), torch.cat(grads, dim)),
        "gather_from_tp": lambda: (torch.cat(xs, dim), chunk(grads[r])),
        "gather_from_sp": lambda: (torch.cat(xs, dim), chunk(sum(grads))),
        "reduce_scatter_to_sp": lambda: (chunk(sum(xs)), torch.cat(grads, dim)),
    }[op]()
    assert_close(y, expected_y, f"{op} forward")
    assert_close(x.grad, expected_grad, f"{op} backward")


OPS = [
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
]


@pytest.mark.parametrize("op", OPS)
def test_collective_matches_closed_form(world, op):
    dims = [0] if op in ("copy_to_tp", "reduce_from_tp") else [0, 1, 2]
    for dim in dims:
        world.run(_run, op, dim)


def _split_indivisible(op: str) -> str | None:
    use_mesh(dist.get_world_size())
    return error_of(getattr(F, op), torch.zeros(3, 5), dim=1)


@pytest.mark.parametrize("op", ["scatter_to_tp", "reduce_scatter_to_sp"])
def test_splitting_an_indivisible_dim_raises(world4, op):
    for message in world4.run(_split_indivisible, op):
        assert message is not None and "not divisible by the group size (4)" in message


def _absent_peer() -> str | None:
    import datetime

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() != 0:
        return None  # rank 1 never joins the all-reduce: it stands for a dead peer
    return error_of(F.reduce_from_tp, torch.ones(3), group=group)


def test_a_peer_that_never_joins_raises_after_the_timeout(world2):
    message = world2.run(_absent_peer)[0]
    assert message is not None and "imed out" in message


def _no_mesh() -> str | None:
    torch_mp.set_mesh(None)
    return error_of(F.copy_to_tp, torch.ones(2))


def test_group_none_without_init_raises(world2):
    for message in world2.run(_no_mesh):
        assert message is not None and "torch_mp.init()" in message


def _collectives_interleaved_with_python_collectives() -> None:
    group = use_mesh(dist.get_world_size()).tp_group
    for _ in range(30):
        x = torch.ones(64, requires_grad=True)
        F.copy_to_tp(F.reduce_from_tp(x, group), group).sum().backward()
        # A Python-side collective on the same group frees tensors Python owns on c10d's worker
        # threads; torch_mp must not hold the GIL while it waits, or the two deadlock.
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(range(2000)), group=group)


def test_collectives_release_the_gil_while_they_wait(world4):
    world4.run(_collectives_interleaved_with_python_collectives)


# ---- collective checks (torch_mp.functional.set_check_collectives) ---------------------------


def _mismatches() -> list[str | None]:
    tpf = F
    rank = dist.get_rank()
    use_mesh(dist.get_world_size())
    tpf.set_check_collectives(True)
    try:
        row = torch_mp.RowParallelLinear(8, 4, input_is_parallel=True)
        column = torch_mp.ColumnParallelLinear(4, 8)
        vocab = 4 * dist.get_world_size()
        return [
            error_of(tpf.reduce_from_tp, torch.ones(4 + rank)),  # other element counts
            error_of(tpf.reduce_from_tp, torch.ones(2, 3) if rank else torch.ones(3, 2)),
            error_of(tpf.gather_from_tp, torch.ones(2, 2 + rank), dim=-1),
            error_of(row, torch.ones(3 + rank, 8 // dist.get_world_size())),  # another batch
            error_of(column, torch.full((2, 4), float(rank))),  # inputs differ
            error_of(
                torch_mp.vocab_parallel_cross_entropy,
                torch.zeros(3, vocab // dist.get_world_size()),
                torch.tensor([0, 1, rank]),  # valid targets that differ
            ),
        ]
    finally:
        tpf.set_check_collectives(False)


def test_checked_collectives_refuse_mismatched_tensors_on_every_rank(world2):
    for messages in world2.run(_mismatches):
        counts, shapes, widths, batch, inputs, targets = messages
        assert "all_reduce: the tensors" in counts and "rank 1: Float[5]" in counts
        assert "rank 0: Float[3, 2]" in shapes and "rank 1: Float[2, 3]" in shapes
        assert "all_gather: the tensors" in widths and "rank 1: Float[2, 3]" in widths
        assert "rank 1: Float[4, 4]" in batch
        assert "copy_to_tp: its input" in inputs
        assert "vocab_parallel_cross_entropy: the targets" in targets
