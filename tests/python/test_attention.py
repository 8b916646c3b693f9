"""ParallelSelfAttention against nn.MultiheadAttention: from_dense / to_dense and default
initialisation."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import use_mesh
from torch import nn

import torch_mp

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


def _attention_round_trip() -> None:
    """from_dense / to_dense of the attention, and default init equal to the seeded dense
    nn.MultiheadAttention."""
    use_mesh(dist.get_world_size())
    torch.manual_seed(1)
    attention = nn.MultiheadAttention(HIDDEN, HEADS)
    back = torch_mp.ParallelSelfAttention.from_dense(attention).to_dense()
    for name, p in attention.named_parameters():
        assert torch.equal(dict(back.named_parameters())[name], p), name
    torch.manual_seed(2)
    drawn = torch_mp.ParallelSelfAttention(HIDDEN, HEADS).to_dense()
    torch.manual_seed(2)
    seeded = nn.MultiheadAttention(HIDDEN, HEADS)
    for name, p in seeded.named_parameters():
        assert torch.equal(dict(drawn.named_parameters())[name], p), name


def test_attention_from_and_to_dense(world):
    world.run(_attention_round_trip)
