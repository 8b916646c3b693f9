"""The tensor-parallel LayerNorm under sequence parallelism: the dense gradients of its
replicated parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import assert_close, rank_tensor, use_mesh
from torch import nn

from torch_mp.tensor_parallel import LayerNorm

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


def _layer_norm_gradients_need_the_sum() -> None:
    """Under sequence parallelism a plain nn.LayerNorm gets only its own rows' gradient; the
    torch_mp LayerNorm gets the dense one (the sum over the group)."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(0)
    dense = nn.LayerNorm(HIDDEN)
    x = rank_tensor(1, 0, 4 * t, BATCH, HIDDEN)
    dense(x).pow(2).sum().backward()
    sp = LayerNorm.from_dense(dense, sequence_parallel=True)
    sp(x.chunk(t, 0)[r]).pow(2).sum().backward()
    assert_close(sp.weight.grad, dense.weight.grad, "weight gradient", GRAD_ATOL)
    assert_close(sp.bias.grad, dense.bias.grad, "bias gradient", GRAD_ATOL)
    with torch.no_grad():
        dense.weight.add_(1.0)
    assert not torch.equal(sp.weight, dense.weight), "from_dense must copy, not share"


def test_sequence_parallel_layer_norm_gradients_equal_dense(world):
    world.run(_layer_norm_gradients_need_the_sum)
