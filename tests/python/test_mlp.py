"""ParallelMLP against torch_mp.dense.MLP on one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import assert_close, rank_tensor, use_mesh

import torch_mp

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


def _mlp_matches_dense() -> None:
    """The MLP sharded from torch_mp.dense.MLP: output and weight gradients."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(3)
    mlp = torch_mp.dense.MLP(HIDDEN, FFN, activation="relu")
    x = rank_tensor(3, 0, 5, BATCH, HIDDEN)
    mlp(x).sum().backward()
    parallel = torch_mp.ParallelMLP.from_dense(mlp)
    y = parallel(x)
    y.sum().backward()
    assert_close(y, mlp(x), "MLP output")
    assert_close(parallel.fc1.weight.grad, mlp.fc1.weight.grad.chunk(t, 0)[r], "fc1", GRAD_ATOL)
    assert_close(parallel.fc2.weight.grad, mlp.fc2.weight.grad.chunk(t, 1)[r], "fc2", GRAD_ATOL)


def test_mlp_from_dense_matches_dense(world):
    world.run(_mlp_matches_dense)
