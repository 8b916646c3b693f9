"""Self-attention with the heads split across the tensor-parallel group (the C++ core's
csrc/torch_mp/tensor_parallel/attention.h; the forward is the operator
``torch.ops.torch_mp.parallel_self_attention``).

Transformer tensors are ``[s, b, h]`` (sequence first); with ``sequence_parallel=True`` each rank
holds ``[s / t, b, h]`` of the input and output, and with ``context_parallel=True`` its part of the
sequence cut by :func:`torch_mp.context_parallel.shard_sequence`. Default initialisation draws the
dense ``nn.MultiheadAttention`` and keeps this rank's heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.context_parallel.sharding import _context_group
from torch_mp.mesh import tp_group_or_default
from torch_mp.tensor_parallel._shell import empty_like_dense, materialise
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


class ParallelSelfAttention(
    DeclaredOptions, SharesGroup, nn.Module, declared="ParallelSelfAttention"
):
    """Multi-head self-attention with the heads split across the tensor-parallel group.

    A column-parallel QKV projection (this rank's heads of Q, K and V), attention over the local
    heads, a row-parallel output projection: one all-reduce forward and one backward (a gather
    and a reduce-scatter under sequence parallelism). Equals ``nn.MultiheadAttention`` applied
    as self-attention (``attn(x, x, x)``) on ``[s, b, h]`` input.

    Args (the options the C++ core declares, csrc/torch_mp/tensor_parallel/attention.h):
        hidden_size: Embedding size ``h``; divisible by ``num_heads``.
        num_heads: Attention heads in all; divisible by the group size.
        bias: Biases on the projections.
        dropout: Dropout on the attention probabilities (training only; per-rank stream of
            :mod:`torch_mp.random` when seeded there).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        recompute_core: Keep only the Q/K/V projection's output for the backward and recompute
            the attention core from it (scores, softmax, dropout with the same masks, the
            product with V): Megatron's selective recomputation.
        context_parallel: The sequence is split over a context group too: input and output
            hold this rank's part of it, as :func:`torch_mp.context_parallel.shard_sequence`
            cut it (``load_balance``), and the attention meets the other parts' keys and
            values by ``context_method`` (:func:`torch_mp.context_parallel.attention`). Masks
            are for the whole sequence. Heads are split over the tensor group first. Attention
            dropout is refused in training (the ranks' masks could not be one process's).
        context_group: The context group; the default mesh's when None.
        context_method: ``"ring"``, ``"all_gather"`` or ``"all_to_all"``.
        load_balance: Whether the sequence was cut load-balanced (``shard_sequence``'s
            default); it must be the cut's.
        softmax_scale: What the scores ``q k^T`` are multiplied by before the softmax;
            ``1 / sqrt(head_dim)`` when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: On every rank, if the sizes do not divide as above, the method is
            unknown, or ranks of the tensor or context group disagree on the configuration.
        ValueError: For a ``context_group`` without ``context_parallel``.
    """

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(args, kwargs, group=tp_group_or_default)
        if self.context_group is not None and not self.context_parallel:
            raise ValueError(
                "ParallelSelfAttention: a context_group is given but context_parallel is off"
            )
        if self.context_parallel:
            self.context_group = o["context_group"] = _context_group(self.context_group)
        self.tp_size = dist.get_world_size(self.group)
        self._check_options(o)
        children = self._children(qkv=ColumnParallelLinear, proj=RowParallelLinear)
        self.qkv = ColumnParallelLinear(**children["qkv"], device="meta")
        self.proj = RowParallelLinear(**children["proj"], device="meta")
        self.qkv._layout_parts = 3  # this rank's rows of Q, of K and of V
        materialise(self, device, dtype)

    # Parameter names in the dense counterpart (to_dense), by prefix (torch_mp.checkpoint): the
    # C++ module's table.
    DENSE_NAMES = dict(_C.dense_names("ParallelSelfAttention"))

    def reset_parameters(self) -> None:
        """Draws an ``nn.MultiheadAttention`` (as it initialises itself) and keeps our heads."""
        self.load_dense(nn.MultiheadAttention(self.hidden_size, self.num_heads, bias=self.bias))

    def load_dense(self, attention: nn.MultiheadAttention) -> None:
        """Copies this rank's heads of ``attention`` into the parameters."""
        if not attention._qkv_same_embed_dim or attention.bias_k is not None:
            raise ValueError("ParallelSelfAttention: kdim/vdim and add_bias_kv are not supported")
        if attention.add_zero_attn:
            raise ValueError("ParallelSelfAttention: add_zero_attn is not supported")
        name = self.group.group_name
        _C.load_dense_qkv_(
            self.qkv.weight, self.qkv.bias, attention.in_proj_weight, attention.in_proj_bias, name
        )
        _C.load_dense_linear_(
            self.proj.weight,
            self.proj.bias,
            attention.out_proj.weight,
            attention.out_proj.bias,
            1,
            name,
        )

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """``x``: ``[s, b, h]`` (``[s / t, b, h]`` under sequence parallelism). ``attn_mask`` as
        in ``nn.MultiheadAttention``: ``[s, s]`` or ``[b * num_heads, s, s]``, bool (True may
        not attend) or float (added), ``s`` the whole sequence under context parallelism;
        ``is_causal`` without a mask applies the causal mask. Key padding masks are not
        supported (fold them into ``attn_mask``)."""
        return torch.ops.torch_mp.parallel_self_attention(
            x,
            self.qkv.weight,
            self.qkv.bias,
            self.proj.weight,
            self.proj.bias,
            attn_mask,
            is_causal,
            self.training,
            **self._operator_options(),
        )

    @classmethod
    def from_dense(cls, attention: nn.MultiheadAttention, *args, **kwargs) -> ParallelSelfAttention:
        """Shards ``attention`` (device and dtype kept, no random draws); ``group`` and
        ``sequence_parallel`` (by position or keyword) and the keyword options as the
        constructor's."""
        taken = {
            "hidden_size": attention.embed_dim,
            "num_heads": attention.num_heads,
            "bias": attention.in_proj_bias is not None,
            "dropout": attention.dropout,
        }
        layer = cls._from_dense(attention, args, kwargs, taken)
        empty_like_dense(attention, layer)
        layer.load_dense(attention)
        return layer

    _FROM_DENSE_POSITIONAL = ("group", "sequence_parallel")

    def to_dense(self) -> nn.MultiheadAttention:
        """The dense ``nn.MultiheadAttention`` (a collective)."""
        name = self.group.group_name
        in_weight, in_bias = _C.gather_dense_qkv(self.qkv.weight, self.qkv.bias, name)
        out_weight, out_bias = _C.gather_dense_linear(self.proj.weight, self.proj.bias, 1, name)
        dense = nn.MultiheadAttention(
            self.hidden_size,
            self.num_heads,
            dropout=self.dropout,
            bias=in_bias is not None,
            device="meta",
        ).to_empty(device=in_weight.device)
        dense.to(dtype=in_weight.dtype)
        with torch.no_grad():
            dense.in_proj_weight.copy_(in_weight)
            dense.out_proj.weight.copy_(out_weight)
            if in_bias is not None:
                dense.in_proj_bias.copy_(in_bias)
                dense.out_proj.bias.copy_(out_bias)
        return dense
