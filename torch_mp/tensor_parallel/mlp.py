"""The tensor-parallel MLP (the C++ core's csrc/torch_mp/tensor_parallel/mlp.h; the forward is
the operator ``torch.ops.torch_mp.parallel_mlp``)."""

from __future__ import annotations

import torch
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.dense import MLP
from torch_mp.mesh import tp_group_or_default
from torch_mp.tensor_parallel._shell import empty_like_dense, materialise
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(DeclaredOptions, SharesGroup, nn.Module, declared="ParallelMLP"):
    """``fc2(dropout(activation(fc1(x))))`` with ``fc1`` column- and ``fc2`` row-parallel.

    Args (the options the C++ core declares, csrc/torch_mp/tensor_parallel/mlp.h):
        hidden_size: Input and output size.
        ffn_hidden_size: Inner size; divisible by the group size.
        bias: Biases on both layers.
        activation: ``"gelu"`` or ``"relu"``.
        dropout: Dropout after the activation (training only; per-rank stream).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.
    """

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(args, kwargs, group=tp_group_or_default)
        self._check_options(o)
        children = self._children(fc1=ColumnParallelLinear, fc2=RowParallelLinear)
        self.fc1 = ColumnParallelLinear(**children["fc1"], device="meta")
        self.fc2 = RowParallelLinear(**children["fc2"], device="meta")
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
            self.hidden_size,
            self.ffn_hidden_size,
            bias=self.bias,
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
            self.training,
            **self._operator_options(),
        )

    _FROM_DENSE_POSITIONAL = ("group", "sequence_parallel")

    @classmethod
    def from_dense(cls, mlp: MLP, *args, **kwargs) -> ParallelMLP:
        """Shards a :class:`torch_mp.dense.MLP` (device and dtype kept, no random draws); the
        options it does not determine (``group``, ``sequence_parallel``) as the constructor's."""
        layer = cls._from_dense(
            mlp,
            args,
            kwargs,
            taken={
                "hidden_size": mlp.fc1.in_features,
                "ffn_hidden_size": mlp.fc1.out_features,
                "bias": mlp.fc1.bias is not None,
                "activation": mlp.activation,
                "dropout": mlp.dropout.p,
            },
        )
        empty_like_dense(mlp, layer)
        layer.load_dense(mlp.fc1, mlp.fc2)
        return layer
