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
from torch_mp.mesh import get_mesh


class _ParallelLinear(SharesGroup, nn.Module):
    """Shared bookkeeping of the two layers.

    Subclasses set ``_SHARD_DIM`` (the dense weight's split dim) and define ``_check(bias)``,
    which validates their options in the C++ core.
    """

    _SHARD_DIM: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: dist.ProcessGroup | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.group = group if group is not None else get_mesh().tp_group
        self.in_features = in_features
        self.out_features = out_features
        self.tp_size = dist.get_world_size(self.group)
        self._check(bias)
        shape = [out_features, in_features]
        shape[self._SHARD_DIM] //= self.tp_size
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            bias_size = out_features // self.tp_size if self._SHARD_DIM == 0 else out_features
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

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None, **kwargs):
        """Shards a dense ``nn.Linear`` (e.g. a pretrained or reference layer).

        Args:
            linear: The dense layer; its device and dtype are kept.
            group: The tensor-parallel group; the default mesh's when None.
            **kwargs: Further constructor arguments (``gather_output``, ``input_is_parallel``,
                ``sequence_parallel``).

        Returns:
            A layer holding this rank's shard of ``linear``'s parameters.
        """
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group=group,
            device="meta",
            **kwargs,
        )
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


class ColumnParallelLinear(_ParallelLinear):
    """A ``Linear`` layer whose output features are split across the tensor-parallel group.

    Args:
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

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        super().__init__(in_features, out_features, bias, group, device, dtype)

    def _check(self, bias: bool) -> None:
        _C.check_column_parallel_linear(
            self.in_features,
            self.out_features,
            bias,
            self.gather_output,
            self.sequence_parallel,
            self._group_name,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_mp.column_parallel_linear(
            input,
            self.weight,
            self.bias,
            self.out_features,
            self.gather_output,
            self.sequence_parallel,
            self._group_name,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, tp_size={self.tp_size}"
        )


class RowParallelLinear(_ParallelLinear):
    """A ``Linear`` layer whose input features are split across the tensor-parallel group.

    The partial products of the ranks are summed (all-reduce) and the bias, whole on every rank,
    is added once after the sum.

    Args:
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

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        super().__init__(in_features, out_features, bias, group, device, dtype)

    def _check(self, bias: bool) -> None:
        _C.check_row_parallel_linear(
            self.in_features,
            self.out_features,
            bias,
            self.input_is_parallel,
            self.sequence_parallel,
            self._group_name,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_mp.row_parallel_linear(
            input,
            self.weight,
            self.bias,
            self.in_features,
            self.input_is_parallel,
            self.sequence_parallel,
            self._group_name,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}, tp_size={self.tp_size}"
        )
