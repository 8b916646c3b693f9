"""LayerNorm inside a tensor-parallel block: replicated parameters that, under sequence
parallelism, get the dense gradient (the C++ core's csrc/torch_mp/tensor_parallel/layer_norm.h,
the operator ``torch.ops.torch_mp.layer_norm``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp.tensor_parallel._shell import tp_group


class LayerNorm(SharesGroup, nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim that also serves inside a sequence-parallel region.

    With ``sequence_parallel=True`` each rank normalises its own rows, and the parameters,
    replicated on every rank, enter through ``copy_to_tp``: their gradients are summed over the
    tensor-parallel group in backward, so every rank gets the gradient of the dense LayerNorm
    (no separate gradient all-reduce is needed).
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype
        )
        if len(self.normalized_shape) != 1:
            raise ValueError("torch_mp LayerNorm normalises over the last dim only")
        self.sequence_parallel = sequence_parallel
        self.group = tp_group(group)
        self._register_layouts()

    def _register_layouts(self) -> None:
        for param in self.parameters(recurse=False):
            _C.set_layout(param, None, self.group.group_name)  # replicated

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_mp.layer_norm(
            input, self.weight, self.bias, self.eps, self.sequence_parallel, self.group.group_name
        )

    @classmethod
    def from_dense(
        cls,
        norm: nn.LayerNorm,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> LayerNorm:
        """A copy of ``norm`` (parameters replicated, not split)."""
        layer = cls(
            norm.normalized_shape[-1],
            norm.eps,
            norm.elementwise_affine,
            norm.bias is not None,
            sequence_parallel,
            group,
            device="meta",
        )
        layer.load_state_dict({k: v.clone() for k, v in norm.state_dict().items()}, assign=True)
        return layer
