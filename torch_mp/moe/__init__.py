"""Expert parallelism: a mixture of experts whose experts are spread over the ranks of an expert
group, tokens routed to them by all-to-all (the C++ core's csrc/torch_mp/moe/; the forward is the
operator ``torch.ops.torch_mp.moe``).

:class:`MoE` equals :class:`torch_mp.dense.MoE` on each rank's tokens: outputs, load-balancing
loss and gradients (the experts' gradients gathering every rank's tokens that went to them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp import dense as dense_modules
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.layout import set_layout
from torch_mp.mesh import get_mesh

__all__ = ["MoE"]


class MoE(DeclaredOptions, SharesGroup, nn.Module, declared="MoE"):
    """A mixture of experts with the experts split over the expert group.

    The arguments of :class:`torch_mp.dense.MoE`, and ``group``. Rank e of the group holds
    experts ``[e * E / ep, (e + 1) * E / ep)``: ``experts`` is a :class:`torch_mp.dense.Experts`
    of ``E / ep`` experts whose parameters are sharded over the group along the experts' dim
    (their layout says so, for checkpoints and gradient norms); the router is replicated.

    ``forward(x)`` takes this rank's tokens ``[..., hidden]`` and returns ``(y, aux_loss)`` as
    the dense module would on them. Each token goes to its experts' ranks by an all-to-all with
    variable counts (the counts exchanged first), the local experts run over the tokens they
    received (one grouped matrix product per projection, ``torch._grouped_mm``, where it takes
    the shapes: no biases, 16-byte aligned rows, fp32/bf16/fp16 on the CPU or bf16 on CUDA; else
    one expert after another), and the results come back by a second all-to-all; the backward
    mirrors it. A collective over the group: every rank must call it, with its own tokens (any
    number of them; with none, the aux loss is NaN, as the dense module's is).

    Args (the options the C++ core declares, csrc/torch_mp/moe/moe.h):
        hidden_size, ffn_hidden_size, num_experts, top_k, activation, router,
            capacity_factor, aux_loss_coef, bias: As in :class:`torch_mp.dense.MoE`.
        group: The expert group; the default mesh's ``ep_group`` when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: On every rank, if the group size does not divide ``num_experts``, the
            routing settings are invalid (``capacity_factor`` must be positive: a capacity of
            zero would drop every token), or ranks disagree on the configuration; in forward,
            if the ranks pass different hidden sizes.
    """

    # The option ``router`` names the routing; the attribute ``router`` is the linear router.
    _ATTRIBUTES = {"router": "router_kind"}

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(
            args, kwargs, group=lambda g: g if g is not None else get_mesh().ep_group
        )
        self._check_options(o)
        self.ep_size = dist.get_world_size(self.group)
        self.router = nn.Linear(self.hidden_size, self.num_experts, bias=False, device="meta")
        with torch.device("meta"):
            self.experts = dense_modules.Experts(
                self.hidden_size,
                self.ffn_hidden_size,
                self.num_experts // self.ep_size,
                self.activation,
                self.bias,
            )
        if device is not None and torch.device(device).type == "meta":
            self._register_layouts()
            return
        self.to_empty(device=device if device is not None else "cpu")
        if dtype is not None:
            self.to(dtype=dtype)
        self.reset_parameters()

    def _register_layouts(self) -> None:
        set_layout(self.router.weight, None, self.group)
        for parameter in self.experts.parameters():  # this rank's experts
            set_layout(parameter, 0, self.group)

    def _dense(self, device=None) -> dense_modules.MoE:
        options = self.options()
        del options["group"]
        return dense_modules.MoE(**options, device=device)

    def reset_parameters(self) -> None:
        """Draws a :class:`torch_mp.dense.MoE` with these arguments and keeps this rank's
        experts (and the router)."""
        self.load_dense(self._dense())

    def load_dense(self, dense: dense_modules.MoE) -> None:
        """Copies ``dense``'s router and this rank's experts into the parameters."""
        weights = dense_modules.moe_weights
        _C.moe_load_dense_(weights(self), weights(dense), self.group.group_name)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_modules.run_moe(self, x)

    @classmethod
    def from_dense(cls, dense: dense_modules.MoE, *args, **kwargs) -> MoE:
        """Shards ``dense`` (device and dtype kept, no random draws); ``group`` (by position or
        keyword) as the constructor's. A collective only in that it checks the configuration
        over the group."""
        layer = cls._from_dense(dense, args, kwargs, dense.options())
        weight = dense.router.weight
        layer.to_empty(device=weight.device)
        layer.to(dtype=weight.dtype)
        layer.load_dense(dense)
        return layer

    def to_dense(self) -> dense_modules.MoE:
        """The dense module, every expert gathered onto every rank (a collective)."""
        weight = self.router.weight
        with torch.device("meta"):
            dense = self._dense()
        dense.to_empty(device=weight.device)
        dense.to(dtype=weight.dtype)
        with torch.no_grad():
            dense.router.weight.copy_(weight)
            theirs = dict(dense.experts.named_parameters())
            for name, value in self.experts.named_parameters():
                theirs[name].copy_(_C.unshard(value.detach(), 0, self.group.group_name))
        return dense
