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

    # Layouts of one's own modules.
    mine = nn.Linear(4, 4)
    torch_mp.set_layout(mine.weight, shard_dim=1)
    assert _describe(mine.weight) == (1, tp, False)


def test_parameters_carry_their_layout(world):
    world.run(_layouts)
