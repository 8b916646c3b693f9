"""Dense (one-process) modules that the tensor-parallel blocks shard with ``from_dense``.

Where PyTorch has the dense module (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``,
``nn.Conv2d``, ``nn.Linear``, ``nn.Embedding``) the parallel module shards that; these are the
ones PyTorch lacks. They are ordinary ``nn.Module``s, usable as one-process references.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from torch_mp._options import DeclaredOptions

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


#: The experts' activations: those of the MLP, and the gated "swiglu" (Mixtral's and LLaMA's
#: ``silu(gate) * up``, the gate and up projections stacked in ``fc1``).
_EXPERT_ACTIVATIONS = (*_ACTIVATIONS, "swiglu")


class Experts(nn.Module):
    """``num_experts`` MLPs ``fc2(activation(fc1(x)))`` stacked: ``fc1_weight``
    ``[E, ffn, hidden]``, ``fc2_weight`` ``[E, hidden, ffn]`` (and ``[E, ffn]``, ``[E, hidden]``
    biases), each expert initialised as an ``nn.Linear`` pair is. The experts' dim comes first,
    so that expert parallelism splits them along it.

    ``activation="swiglu"`` makes them gated, as Mixtral's: ``fc1_weight`` is
    ``[E, 2 * ffn, hidden]``, the gate projection's rows then the up projection's, and an expert
    is ``fc2(silu(gate(x)) * up(x))``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        activation: str = "gelu",
        bias: bool = False,
    ) -> None:
        super().__init__()
        if activation not in _EXPERT_ACTIVATIONS:
            raise ValueError(
                f"Experts: activation must be 'relu', 'gelu' or 'swiglu', got {activation!r}"
            )
        self.activation = activation
        e, h, f = num_experts, hidden_size, ffn_hidden_size
        rows = 2 * f if activation == "swiglu" else f
        self.fc1_weight = nn.Parameter(torch.empty(e, rows, h))
        self.fc2_weight = nn.Parameter(torch.empty(e, h, f))
        self.fc1_bias = nn.Parameter(torch.empty(e, rows)) if bias else None
        self.fc2_bias = nn.Parameter(torch.empty(e, h)) if bias else None
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self.fc1_weight.shape[0]

    def reset_parameters(self) -> None:
        """Each expert's pair drawn as ``nn.Linear`` draws itself, expert after expert."""
        with torch.no_grad():
            for i in range(self.num_experts):
                for weight, bias in (
                    (self.fc1_weight, self.fc1_bias),
                    (self.fc2_weight, self.fc2_bias),
                ):
                    linear = nn.Linear(weight.shape[2], weight.shape[1], bias=bias is not None)
                    weight[i].copy_(linear.weight)
                    if bias is not None:
                        bias[i].copy_(linear.bias)

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``i`` on the rows ``x`` ``[n, hidden]``."""
        b1 = None if self.fc1_bias is None else self.fc1_bias[i]
        b2 = None if self.fc2_bias is None else self.fc2_bias[i]
        hidden = F.linear(x, self.fc1_weight[i], b1)
        if self.activation == "swiglu":
            gate, up = hidden.chunk(2, -1)
            hidden = F.silu(gate) * up
        else:
            hidden = _ACTIVATIONS[self.activation](hidden)
        return F.linear(hidden, self.fc2_weight[i], b2)


class MoE(DeclaredOptions, nn.Module, declared="dense.MoE"):
    """A mixture of experts on one process, which :class:`torch_mp.moe.MoE` equals with its
    experts spread over ranks. Its options are the C++ core's declaration
    (csrc/torch_mp/moe/dense_moe.h); its forward is the core's operator ``torch.ops.torch_mp.moe``
    with every expert on this process (tests/python/test_moe.py holds it to a token-by-token
    reading of the definition below).

    A linear router (no bias) scores every token against every expert and keeps the ``top_k``
    best: ``"softmax"`` takes the softmax over all experts, then the top k, their weights
    renormalised to sum to 1 (Mixtral's); ``"sigmoid"`` takes each expert's sigmoid, then the
    top k, renormalised likewise (DeepSeek-V3's). Each token's output is the weighted sum of its
    experts' outputs (:class:`Experts`; ``activation`` is theirs: ``"gelu"``, ``"relu"`` or the
    gated ``"swiglu"``). Routing runs in at least fp32 whatever the dtype of ``x``.

    ``capacity_factor=None`` is dropless. A number caps each expert at
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` tokens; the tokens past the cap, in
    token order, get nothing from that expert.

    ``forward(x)`` takes ``[..., hidden]`` and returns ``(y, aux_loss)``: ``y`` shaped as ``x``,
    ``aux_loss`` the load-balancing loss of Switch / GShard over this call's tokens,
    ``aux_loss_coef * E * sum_i f_i * P_i``, with ``f_i`` the share of the ``tokens * top_k``
    choices that picked expert ``i`` (before any cap) and ``P_i`` the mean over the tokens of
    expert ``i``'s probability (the softmax; for ``"sigmoid"``, the scores normalised to sum to
    1 over the experts).
    """

    # The option ``router`` names the routing; the attribute ``router`` is the linear router.
    _ATTRIBUTES = {"router": "router_kind"}

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        self._check_options(self._take_options(args, kwargs))
        self.router = nn.Linear(self.hidden_size, self.num_experts, bias=False)
        self.experts = Experts(
            self.hidden_size, self.ffn_hidden_size, self.num_experts, self.activation, self.bias
        )
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_moe(self, x)


def run_moe(moe: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The core's operator ``torch.ops.torch_mp.moe`` on ``moe``'s router and experts, with its
    options (a :class:`MoE`, or a :class:`torch_mp.moe.MoE`, whose options add its group)."""
    return torch.ops.torch_mp.moe(x, *moe_weights(moe), **moe._operator_options())


def moe_weights(moe: nn.Module) -> list[torch.Tensor | None]:
    """A mixture of experts' router weight and experts' weights (fc1, its bias, fc2, its bias),
    as the core takes them."""
    e = moe.experts
    return [moe.router.weight, e.fc1_weight, e.fc1_bias, e.fc2_weight, e.fc2_bias]
