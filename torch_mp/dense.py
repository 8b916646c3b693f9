"""Dense (one-process) modules that the tensor-parallel blocks shard with ``from_dense``.

Where PyTorch has the dense module (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``,
``nn.Conv2d``, ``nn.Linear``, ``nn.Embedding``) the parallel module shards that; these are the
ones PyTorch lacks. They are ordinary ``nn.Module``s, usable as one-process references.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class MLP(nn.Module):
    """``fc2(dropout(activation(fc1(x))))`` with ``fc1: hidden -> ffn``, ``fc2: ffn -> hidden``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        activation: str = "gelu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"MLP: activation must be 'relu' or 'gelu', got {activation!r}")
        self.activation = activation
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(_ACTIVATIONS[self.activation](self.fc1(x))))


class ConvBlock(nn.Module):
    """``conv2(relu(norm(conv1(x))))``: Conv2d (in -> mid), BatchNorm2d, ReLU, Conv2d (mid -> out),
    both convolutions with the same square kernel and padding (default ``kernel_size // 2``)."""

    def __init__(
        self,
        in_channels: int,
        mid_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        padding: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        padding = kernel_size // 2 if padding is None else padding
        self.conv1 = nn.Conv2d(in_channels, mid_channels, kernel_size, padding=padding, bias=bias)
        self.norm = nn.BatchNorm2d(mid_channels)
        self.conv2 = nn.Conv2d(mid_channels, out_channels, kernel_size, padding=padding, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.norm(self.conv1(x))))
