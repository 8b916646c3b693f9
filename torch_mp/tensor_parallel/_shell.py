"""What the tensor-parallel block modules share: building children on the meta device and
giving them storage afterwards."""

from __future__ import annotations

import torch
from torch import nn

from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


def column_row_pair(
    column: tuple[int, int], row: tuple[int, int], bias: bool, sequence_parallel: bool, group
) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    """A column layer and a row layer (input split, as a column layer leaves it) of the given
    (in, out) sizes, built on the meta device for the caller to fill."""
    common = {"sequence_parallel": sequence_parallel, "group": group, "device": "meta"}
    return ColumnParallelLinear(*column, bias, **common), RowParallelLinear(*row, bias, **common)


def materialise(module: nn.Module, device, dtype) -> None:
    """Gives a module built on the meta device real storage and initialises it (unless the caller
    asked for meta, as from_dense does before loading)."""
    if device is not None and torch.device(device).type == "meta":
        return
    module.to_empty(device=device if device is not None else "cpu")
    if dtype is not None:
        module.to(dtype=dtype)
    module.reset_parameters()


def empty_like_dense(dense: nn.Module, module: nn.Module) -> None:
    """Gives ``module`` (built on meta) storage on ``dense``'s device and dtype."""
    weight = next(dense.parameters())
    module.to_empty(device=weight.device)
    module.to(dtype=weight.dtype)
