"""Channel-parallel ``Conv2d`` layers.

Thin ``nn.Module`` wrappers over the C++ core (csrc/torch_mp/tensor_parallel/conv.h, which
declares their options), whose forwards are the operators
``torch.ops.torch_mp.column_parallel_conv2d`` / ``row_parallel_conv2d``::

    ColumnParallelConv2d   output channels split: weight [out/t, in, kh, kw], bias [out/t]
    RowParallelConv2d      input channels split:  weight [out, in/t, kh, kw], partial outputs
                           all-reduced, then the (whole) bias added once

They take every argument ``nn.Conv2d`` takes with ``groups=1`` (stride, padding as numbers or
``"same"``/``"valid"``, dilation, padding_mode ``"zeros"``/``"reflect"``/``"replicate"``/
``"circular"``), on NCHW or unbatched CHW input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import _pair

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.mesh import tp_group_or_default


class _ParallelConv2d(DeclaredOptions, SharesGroup, nn.Module):
    """What the two layers share; subclasses set ``_SHARD_DIM`` and their ``_OPERATOR``."""

    _SHARD_DIM: int
    _OPERATOR: str
    _PARAMETER_OPTIONS = frozenset({"bias"})

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(
            args,
            kwargs,
            kernel_size=_pair,
            stride=_pair,
            padding=lambda p: p if isinstance(p, str) else _pair(p),
            dilation=_pair,
            group=tp_group_or_default,
        )
        self.tp_size = dist.get_world_size(self.group)
        self._check_options(o)
        shape = [self.out_channels, self.in_channels, *self.kernel_size]
        shape[self._SHARD_DIM] //= self.tp_size
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if o["bias"]:
            bias_size = shape[0] if self._SHARD_DIM == 0 else self.out_channels
            self.bias = nn.Parameter(torch.empty(bias_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._register_layouts()

    def _register_layouts(self) -> None:
        _C.set_weight_and_bias_layout(
            self.weight, self.bias, self._SHARD_DIM, self.group.group_name
        )

    def reset_parameters(self) -> None:
        """Draws this rank's shard of a dense layer initialised exactly as ``nn.Conv2d`` is."""
        _C.init_sharded_like_dense_(self.weight, self.bias, self._SHARD_DIM, self.group.group_name)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        operator = getattr(torch.ops.torch_mp, self._OPERATOR)
        return operator(input, self.weight, self.bias, **self._operator_options())

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, *args, **kwargs):
        """Shards a dense ``nn.Conv2d`` (device and dtype kept, no random draws).

        ``group`` (by position or keyword) and the parallel option (``gather_output`` /
        ``input_is_parallel``) as the constructor's.
        """
        taken = {
            "in_channels": conv.in_channels,
            "out_channels": conv.out_channels,
            "kernel_size": conv.kernel_size,
            "stride": conv.stride,
            "padding": conv.padding,
            "dilation": conv.dilation,
            "groups": conv.groups,
            "bias": conv.bias is not None,
            "padding_mode": conv.padding_mode,
        }
        layer = cls._from_dense(conv, args, kwargs, taken)
        layer.to_empty(device=conv.weight.device)
        layer.to(dtype=conv.weight.dtype)
        layer.load_dense(conv)
        return layer

    def load_dense(self, conv: nn.Conv2d) -> None:
        """Copies this rank's shard of a dense ``nn.Conv2d`` into the parameters."""
        _C.load_dense_linear_(
            self.weight, self.bias, conv.weight, conv.bias, self._SHARD_DIM, self.group.group_name
        )

    def to_dense(self) -> nn.Conv2d:
        """Gathers the shards into a dense ``nn.Conv2d`` on every rank (a collective)."""
        dense = nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.groups,
            bias=self.bias is not None,
            padding_mode=self.padding_mode,
            device="meta",
        ).to_empty(device=self.weight.device)
        dense.to(dtype=self.weight.dtype)
        weight, bias = _C.gather_dense_linear(
            self.weight, self.bias, self._SHARD_DIM, self.group.group_name
        )
        with torch.no_grad():
            dense.weight.copy_(weight)
            if bias is not None:
                dense.bias.copy_(bias)
        return dense


class ColumnParallelConv2d(_ParallelConv2d, declared="ColumnParallelConv2d"):
    """An ``nn.Conv2d`` whose output channels are split across the tensor-parallel group.

    Args (the options the C++ core declares):
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
        padding_mode: As for ``nn.Conv2d`` (``groups`` must be 1; ``out_channels`` divisible by
            the group size).
        gather_output: All-gather the output channels so every rank gets all of them; otherwise
            each rank returns its ``out_channels / t`` (the usual input of a
            :class:`RowParallelConv2d`).
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``out_channels`` is not divisible by the group size, the geometry is
            invalid, or ranks disagree on the arguments.
    """

    _SHARD_DIM = 0
    _OPERATOR = "column_parallel_conv2d"


class RowParallelConv2d(_ParallelConv2d, declared="RowParallelConv2d"):
    """An ``nn.Conv2d`` whose input channels are split across the tensor-parallel group.

    The partial outputs of the ranks are summed (all-reduce) and the bias, whole on every rank,
    is added once after the sum.

    Args (the options the C++ core declares):
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
        padding_mode: As for ``nn.Conv2d`` (``groups`` must be 1; ``in_channels`` divisible by
            the group size).
        input_is_parallel: The input already holds this rank's ``in_channels / t`` channels (as a
            :class:`ColumnParallelConv2d` returns them); otherwise it is split here.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``in_channels`` is not divisible by the group size, the geometry is
            invalid, or ranks disagree on the arguments.
    """

    _SHARD_DIM = 1
    _OPERATOR = "row_parallel_conv2d"
