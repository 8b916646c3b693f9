"""The tensor-parallel MLP (the C++ core's csrc/torch_mp/tensor_parallel/mlp.h; the forward is
the operator ``torch.ops.torch_mp.parallel_mlp``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp.dense import MLP
from torch_mp.tensor_parallel._shell import (
    column_row_pair,
    empty_like_dense,
    materialise,
    tp_group,
)


class ParallelMLP(SharesGroup, nn.Module):
    """``fc2(dropout(activation(fc1(x))))`` with ``fc1`` column- and ``fc2`` row-parallel.

    Args:
        hidden_size: Input and output size.
        ffn_hidden_size: Inner size; divisible by the group size.
        bias: Biases on both layers.
        activation: ``"gelu"`` or ``"relu"``.
        dropout: Dropout after the activation (training only; per-rank stream).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        activation: str = "gelu",
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = tp_group(group)
        _C.check_parallel_mlp(
            hidden_size,
            ffn_hidden_size,
            bias,
            activation,
            dropout,
            sequence_parallel,
            self.group.group_name,
        )
        self.activation, self.dropout = activation, dropout
        self.fc1, self.fc2 = column_row_pair(
            (hidden_size, ffn_hidden_size),
            (ffn_hidden_size, hidden_size),
            bias,
            sequence_parallel,
            self.group,
        )
        materialise(self, device, dtype)

    def reset_parameters(self) -> None:
        """Draws fc1 then fc2 as two ``nn.Linear`` layers would be drawn."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def load_dense(self, fc1: nn.Linear | MLP, fc2: nn.Linear | None = None) -> None:
        """Copies this rank's shards of a :class:`torch_mp.dense.MLP` (or of its dense pair
        ``fc1, fc2``) into the parameters."""
        if isinstance(fc1, MLP):
            fc1, fc2 = fc1.fc1, fc1.fc2
        name = self.group.group_name
        _C.load_dense_linear_(self.fc1.weight, self.fc1.bias, fc1.weight, fc1.bias, 0, name)
        _C.load_dense_linear_(self.fc2.weight, self.fc2.bias, fc2.weight, fc2.bias, 1, name)

    def to_dense(self) -> MLP:
        """Gathers the shards into a :class:`torch_mp.dense.MLP` on every rank (a collective)."""
        mlp = MLP(
            self.fc1.in_features,
            self.fc1.out_features,
            bias=self.fc1.bias is not None,
            activation=self.activation,
            dropout=self.dropout,
        )
        mlp.fc1, mlp.fc2 = self.fc1.to_dense(), self.fc2.to_dense()
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_mp.parallel_mlp(
            x,
            self.fc1.weight,
            self.fc1.bias,
            self.fc2.weight,
            self.fc2.bias,
            self.activation,
            self.dropout,
            self.fc1.sequence_parallel,
            self.training,
            self.group.group_name,
        )

    @classmethod
    def from_dense(
        cls, mlp: MLP, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False
    ) -> ParallelMLP:
        """Shards a :class:`torch_mp.dense.MLP` (device and dtype kept, no random draws)."""
        layer = cls(
            mlp.fc1.in_features,
            mlp.fc1.out_features,
            bias=mlp.fc1.bias is not None,
            activation=mlp.activation,
            dropout=mlp.dropout.p,
            sequence_parallel=sequence_parallel,
            group=group,
            device="meta",
        )
        empty_like_dense(mlp, layer)
        layer.load_dense(mlp.fc1, mlp.fc2)
        return layer
