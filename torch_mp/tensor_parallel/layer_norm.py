"""LayerNorm inside a tensor-parallel block: replicated parameters that, under sequence
parallelism, get the dense gradient (the C++ core's csrc/torch_mp/tensor_parallel/layer_norm.h,
which declares its options, and the operator ``torch.ops.torch_mp.layer_norm``)."""

from __future__ import annotations

import torch
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.mesh import tp_group_or_default


class LayerNorm(DeclaredOptions, SharesGroup, nn.LayerNorm, declared="LayerNorm"):
    """``nn.LayerNorm`` over the last dim that also serves inside a sequence-parallel region.

    With ``sequence_parallel=True`` each rank normalises its own rows, and the parameters,
    replicated on every rank, enter through ``copy_to_tp``: their gradients are summed over the
    tensor-parallel group in backward, so every rank gets the gradient of the dense LayerNorm
    (no separate gradient all-reduce is needed).

    Args: ``nn.LayerNorm``'s (``normalized_shape`` one size, the last dim's), then
        ``sequence_parallel`` and ``group`` (the tensor-parallel group; the default mesh's when
        None).
    """

    _PARAMETER_OPTIONS = frozenset({"bias"})

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        o = self._take_options(args, kwargs, normalized_shape=_sizes, group=tp_group_or_default)
        self._check_options(o)
        super().__init__(
            o["normalized_shape"],
            o["eps"],
            o["elementwise_affine"],
            o["bias"],
            device=device,
            dtype=dtype,
        )
        self._register_layouts()

    def _register_layouts(self) -> None:
        for param in self.parameters(recurse=False):
            _C.set_layout(param, None, self.group.group_name)  # replicated

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_mp.layer_norm(
            input, self.weight, self.bias, **self._operator_options()
        )

    _FROM_DENSE_POSITIONAL = ("sequence_parallel", "group")

    @classmethod
    def from_dense(cls, norm: nn.LayerNorm, *args, **kwargs) -> LayerNorm:
        """A copy of ``norm`` (parameters replicated, not split); ``sequence_parallel`` and
        ``group`` as the constructor's."""
        taken = {
            "normalized_shape": norm.normalized_shape,
            "eps": norm.eps,
            "elementwise_affine": norm.elementwise_affine,
            "bias": norm.bias is not None,
        }
        layer = cls._from_dense(norm, args, kwargs, taken)
        layer.load_state_dict({k: v.clone() for k, v in norm.state_dict().items()}, assign=True)
        return layer


def _sizes(shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)
