"""Column- and row-parallel ``Linear`` layers.

Thin ``nn.Module`` wrappers: they own the parameter shards; checks, initialisation and the
forward math are the C++ core's (csrc/torch_mp/tensor_parallel/linear.h), the forwards reached
as the operators ``torch.ops.torch_mp.column_parallel_linear`` / ``row_parallel_linear`` in eager
code and under ``torch.compile`` alike::

    ColumnParallelLinear   Y_i = X A_i^T + b_i      weight [out/t, in]   (chunk tp_rank of dim 0)
    RowParallelLinear      Y = sum_i X_i A_i^T + b  weight [out, in/t]   (chunk tp_rank of dim 1)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.mesh import tp_group_or_default


class _ParallelLinear(DeclaredOptions, SharesGroup, nn.Module):
    """What the two layers share: their options are the C++ core's declaration
    (csrc/torch_mp/tensor_parallel/linear.h); subclasses set ``_SHARD_DIM`` (the dense weight's
    split dim) and their operator ``_OPERATOR``."""

    _SHARD_DIM: int
    _OPERATOR: str
    _PARAMETER_OPTIONS = frozenset({"bias"})

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(args, kwargs, group=tp_group_or_default)
        self.tp_size = dist.get_world_size(self.group)
        self._check_options(o)
        shape = [o["out_features"], o["in_features"]]
        shape[self._SHARD_DIM] //= self.tp_size
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if o["bias"]:
            bias_size = shape[0] if self._SHARD_DIM == 0 else o["out_features"]
            self.bias = nn.Parameter(torch.empty(bias_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._register_layouts()

    @property
    def _group_name(self) -> str:
        return self.group.group_name

    # Equal parts of the output dim, each split over the group on its own (3 for a fused Q/K/V
    # projection, set by ParallelSelfAttention): recorded in the layout, for checkpoints.
    _layout_parts = 1

    def _register_layouts(self) -> None:
        _C.set_weight_and_bias_layout(self.weight, self.bias, self._SHARD_DIM, self._group_name)
        if self._layout_parts != 1:
            for param in (self.weight, self.bias):
                if param is not None:
                    _C.set_layout(param, 0, self._group_name, self._layout_parts)

    def reset_parameters(self) -> None:
        """Draws this rank's shard of a dense layer initialised exactly as ``nn.Linear`` is.

        Ranks seeded alike (``torch.manual_seed``) hold shards of one dense layer, equal to the
        ``nn.Linear`` the same seed gives.
        """
        _C.init_parallel_linear_(
            self.weight,
            self.bias,
            self.in_features,
            self.out_features,
            self._SHARD_DIM,
            self._group_name,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        operator = getattr(torch.ops.torch_mp, self._OPERATOR)
        return operator(input, self.weight, self.bias, **self._operator_options())

    @classmethod
    def from_dense(cls, linear: nn.Linear, *args, **kwargs):
        """Shards a dense ``nn.Linear`` (e.g. a pretrained or reference layer).

        Args:
            linear: The dense layer; its device and dtype are kept.
            *args, **kwargs: The options the dense layer does not give: ``group`` (the
                tensor-parallel group; the default mesh's when None) by position or keyword,
                the others (``gather_output`` or ``input_is_parallel``, ``sequence_parallel``)
                by keyword.

        Returns:
            A layer holding this rank's shard of ``linear``'s parameters.
        """
        taken = {
            "in_features": linear.in_features,
            "out_features": linear.out_features,
            "bias": linear.bias is not None,
        }
        layer = cls._from_dense(linear, args, kwargs, taken)
        layer.to_empty(device=linear.weight.device)
        layer.to(dtype=linear.weight.dtype)
        layer.load_dense(linear)
        return layer

    def load_dense(self, linear: nn.Linear) -> None:
        """Copies this rank's shard of a dense ``nn.Linear`` into the parameters."""
        _C.load_dense_linear_(
            self.weight, self.bias, linear.weight, linear.bias, self._SHARD_DIM, self._group_name
        )

    def to_dense(self) -> nn.Linear:
        """Gathers the shards into a dense ``nn.Linear`` on every rank (a collective)."""
        # Built on the meta device (drawing no random numbers), then given real storage.
        dense = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta"
        ).to_empty(device=self.weight.device)
        dense.to(dtype=self.weight.dtype)
        weight, bias = _C.gather_dense_linear(
            self.weight, self.bias, self._SHARD_DIM, self._group_name
        )
        with torch.no_grad():
            dense.weight.copy_(weight)
            if bias is not None:
                dense.bias.copy_(bias)
        return dense


class ColumnParallelLinear(_ParallelLinear, declared="ColumnParallelLinear"):
    """A ``Linear`` layer whose output features are split across the tensor-parallel group.

    Args (the options the C++ core declares):
        in_features: Size of each input sample.
        out_features: Size of each output sample of the dense layer; divisible by the group size.
        bias: Whether to add a (likewise split) bias.
        gather_output: All-gather the output so that every rank gets all ``out_features``;
            otherwise each rank returns its ``out_features / t`` columns (the usual input of a
            :class:`RowParallelLinear`).
        sequence_parallel: The input is split along the sequence dim 0 (``[s, b, h]`` layout) and
            all-gathered before the product; the gradient is reduce-scattered back.
        group: The tensor-parallel group; the default mesh's (``torch_mp.init``) when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``out_features`` is not divisible by the group size, if both
            ``gather_output`` and ``sequence_parallel`` are set, or if ranks disagree on the
            arguments.
    """

    _SHARD_DIM = 0
    _OPERATOR = "column_parallel_linear"


class RowParallelLinear(_ParallelLinear, declared="RowParallelLinear"):
    """A ``Linear`` layer whose input features are split across the tensor-parallel group.

    The partial products of the ranks are summed (all-reduce) and the bias, whole on every rank,
    is added once after the sum.

    Args (the options the C++ core declares):
        in_features: Size of each input sample of the dense layer; divisible by the group size.
        out_features: Size of each output sample.
        bias: Whether to add a bias.
        input_is_parallel: The input is already this rank's slice of the last dim (as a
            :class:`ColumnParallelLinear` returns it); otherwise it is split here.
        sequence_parallel: Reduce-scatter the output along the sequence dim 0 instead of
            all-reducing it (needs ``input_is_parallel``).
        group: The tensor-parallel group; the default mesh's (``torch_mp.init``) when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``in_features`` is not divisible by the group size, if
            ``sequence_parallel`` is set without ``input_is_parallel``, or if ranks disagree on
            the arguments.
    """

    _SHARD_DIM = 1
    _OPERATOR = "row_parallel_linear"
