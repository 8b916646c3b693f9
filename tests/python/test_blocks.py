"""Building the blocks (attention, MLP, transformer layer, conv block): sizes the group does not
divide and configurations that differ between ranks raise on every rank, and default
initialisation draws the dense modules the same seed gives."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import error_of, use_mesh
from torch import nn

import torch_mp

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


def _indivisible_blocks() -> list[str | None]:
    use_mesh(dist.get_world_size())
    return [
        error_of(torch_mp.ParallelSelfAttention, 12, 6),
        error_of(torch_mp.ParallelTransformerLayer, 16, 4, 30),
        error_of(torch_mp.ParallelConvBlock, 3, 6, 5),
        error_of(torch_mp.ParallelSelfAttention, 12, 5),
    ]


def test_head_and_channel_counts_not_divisible_raise(world4):
    for heads, ffn, channels, head_dim in world4.run(_indivisible_blocks):
        assert "num_heads (6) must be divisible by the tensor-parallel size (4)" in heads
        assert "ffn_hidden_size (30) must be divisible by the tensor-parallel size (4)" in ffn
        assert "mid_channels (6) must be divisible by the tensor-parallel size (4)" in channels
        assert "hidden_size (12) must be divisible by num_heads (5)" in head_dim


def _default_init_equals_seeded_dense() -> None:
    """Ranks seeded alike hold parts of the dense module the same seed gives."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(6)
    layer = torch_mp.ParallelTransformerLayer(HIDDEN, HEADS, FFN, norm_first=True)
    torch.manual_seed(6)
    dense = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, norm_first=True)
    back = layer.self_attn.to_dense()
    assert torch.equal(back.in_proj_weight, dense.self_attn.in_proj_weight)
    assert torch.equal(layer.mlp.fc1.weight, dense.linear1.weight.chunk(t, 0)[r])
    assert torch.equal(layer.mlp.fc2.weight, dense.linear2.weight.chunk(t, 1)[r])
    torch.manual_seed(7)
    block = torch_mp.ParallelConvBlock(3, 8, 5)
    torch.manual_seed(7)
    dense_block = torch_mp.dense.ConvBlock(3, 8, 5)
    assert torch.equal(block.conv1.to_dense().weight, dense_block.conv1.weight)
    assert torch.equal(block.conv2.to_dense().bias, dense_block.conv2.bias)
    torch.manual_seed(8)
    mlp = torch_mp.ParallelMLP(HIDDEN, FFN)
    torch.manual_seed(8)
    dense_mlp = torch_mp.dense.MLP(HIDDEN, FFN)
    assert torch.equal(mlp.fc2.to_dense().weight, dense_mlp.fc2.weight)


def test_default_init_equals_the_seeded_dense_modules(world):
    world.run(_default_init_equals_seeded_dense)


def _block_config_differs_between_ranks() -> list[str | None]:
    use_mesh(dist.get_world_size())
    first = dist.get_rank() == 0
    tanh = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, activation=nn.GELU(approximate="tanh"))
    return [
        error_of(torch_mp.ParallelTransformerLayer, HIDDEN, HEADS, FFN, norm_first=first),
        error_of(torch_mp.ParallelMLP, HIDDEN, FFN, activation="gelu" if first else "swish"),
        error_of(torch_mp.ParallelSelfAttention, HIDDEN, HEADS, dropout=0.1 if first else 0.0),
        error_of(torch_mp.ParallelTransformerLayer.from_dense, tanh),
    ]


def test_block_configs_that_differ_between_ranks_raise_on_every_rank(world2):
    for norm_first, activation, dropout, tanh in world2.run(_block_config_differs_between_ranks):
        # Each names the option that differs, with this rank's value (and every rank's number).
        assert "ParallelTransformerLayer configuration must be the same" in norm_first
        assert "norm_first (here " in norm_first and "by rank [1, 0]" in norm_first
        assert "ParallelMLP configuration" in activation and "same on every rank" in activation
        assert "activation (here " in activation and "hidden_size" not in activation
        assert "ParallelSelfAttention configuration" in dropout and "dropout (here 0" in dropout
        assert "only relu and (exact) gelu" in tanh
