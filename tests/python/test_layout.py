"""Every parameter a torch_mp layer creates knows how it lies on the mesh, and keeps knowing it
when the tensor is replaced (to_empty, load_state_dict(assign=True), deepcopy)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from reference import use_mesh
from torch import nn

import torch_mp
from torch_mp import dense, layout_of


def _describe(param: torch.Tensor) -> tuple | None:
    layout = layout_of(param)
    return None if layout is None else (layout.shard_dim, layout.group_name, layout.tied_copy)


def _layouts() -> None:
    mesh = use_mesh(dist.get_world_size())
    tp = mesh.tp_group.group_name
    column = torch_mp.ColumnParallelLinear(8, 16)
    row = torch_mp.RowParallelLinear(16, 8)
    assert _describe(column.weight) == (0, tp, False)
    assert _describe(column.bias) == (0, tp, False)
    assert _describe(row.weight) == (1, tp, False)
    assert _describe(row.bias) == (None, tp, False)  # added once, after the reduction
    assert _describe(torch_mp.VocabParallelEmbedding(13, 4).weight) == (0, tp, False)
    assert _describe(torch_mp.ColumnParallelConv2d(2, 4, 3).weight) == (0, tp, False)
    assert _describe(torch_mp.RowParallelConv2d(4, 2, 3).bias) == (None, tp, False)
    norm = torch_mp.tensor_parallel.LayerNorm(8)
    assert _describe(norm.weight) == (None, tp, False)
    block = torch_mp.ParallelConvBlock(2, 4, 2)
    assert _describe(block.norm.weight) == (0, tp, False)  # this rank's channels
    layer = torch_mp.ParallelTransformerLayer(8, 4, 16, dropout=0.0)
    assert _describe(layer.self_attn.qkv.weight) == (0, tp, False)
    assert _describe(layer.norm1.bias) == (None, tp, False)
    assert layout_of(nn.Linear(2, 2).weight) is None  # not ours: treated as replicated

    # Replaced tensors are registered again.
    sharded = torch_mp.ColumnParallelLinear.from_dense(nn.Linear(8, 16))  # meta -> to_empty
    assert _describe(sharded.weight) == (0, tp, False)
    assert _describe(copy.deepcopy(column).weight) == (0, tp, False)
    assert _describe(torch_mp.tensor_parallel.LayerNorm.from_dense(nn.LayerNorm(8)).bias)[0] is None
    assert (
        _describe(torch_mp.ParallelConvBlock.from_dense(dense.ConvBlock(2, 4, 2)).norm.bias)[0] == 0
    )
    assert _describe(column.to(torch.float64).weight) == (0, tp, False)

    # Where checkpoints find the blocks: a fused Q/K/V weight in three parts, a vocabulary
    # padded past its size, BatchNorm statistics over this rank's channels; kept when the
    # tensors are replaced, whichever module's load runs last.
    assert layout_of(layer.self_attn.qkv.weight).parts == 3
    assert layout_of(torch_mp.VocabParallelEmbedding(13, 4).weight).dense_size == 13
    assert layout_of(block.norm.running_mean).shard_dim == 0
    attention = torch_mp.ParallelSelfAttention(8, 4)
    attention.load_state_dict(
        {k: torch.zeros_like(v) for k, v in attention.state_dict().items()}, assign=True
    )
    assert layout_of(attention.qkv.weight).parts == 3
    assert layout_of(copy.deepcopy(attention).qkv.bias).parts == 3
    block.load_state_dict({k: v.clone() for k, v in block.state_dict().items()}, assign=True)
    assert layout_of(block.norm.running_var).shard_dim == 0
    assert layout_of(block.norm.weight).shard_dim == 0

    # Layouts of one's own modules.
    mine = nn.Linear(4, 4)
    torch_mp.set_layout(mine.weight, shard_dim=1)
    assert _describe(mine.weight) == (1, tp, False)


def test_parameters_carry_their_layout(world):
    world.run(_layouts)
