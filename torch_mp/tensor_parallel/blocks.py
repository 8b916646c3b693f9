"""Tensor-parallel building blocks: LayerNorm under sequence parallelism, self-attention with the
heads split, an MLP, a transformer layer and a channel-parallel convolutional block.

Each equals its dense counterpart given the same weights, and ``from_dense`` shards one:
``nn.MultiheadAttention``, :class:`torch_mp.dense.MLP`, ``nn.TransformerEncoderLayer``,
:class:`torch_mp.dense.ConvBlock`. Transformer tensors are ``[s, b, h]`` (sequence first); with
``sequence_parallel=True`` each rank holds ``[s / t, b, h]`` between blocks. The math (attention
over the local heads, LayerNorm with replicated parameters, dropout streams, QKV sharding) is
the C++ core's (csrc/torch_mp/tensor_parallel/blocks.h); the C++ modules of the same names are
built the same way.

Default initialisation draws the dense module (e.g. ``nn.MultiheadAttention``) and keeps this
rank's part, so ranks seeded alike hold one dense model, the one that seed gives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from torch_mp import _C, ops
from torch_mp._group import SharesGroup
from torch_mp.dense import MLP, ConvBlock
from torch_mp.mesh import get_mesh
from torch_mp.tensor_parallel.conv import ColumnParallelConv2d, RowParallelConv2d
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else get_mesh().tp_group


def _column_row_pair(
    column: tuple[int, int], row: tuple[int, int], bias: bool, sequence_parallel: bool, group
) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    """A column layer and a row layer (input split, as a column layer leaves it) of the given
    (in, out) sizes, built on the meta device for the caller to fill."""
    common = {"sequence_parallel": sequence_parallel, "group": group, "device": "meta"}
    return ColumnParallelLinear(*column, bias, **common), RowParallelLinear(*row, bias, **common)


def _materialise(module: nn.Module, device, dtype) -> None:
    """Gives a module built on the meta device real storage and initialises it (unless the caller
    asked for meta, as from_dense does before loading)."""
    if device is not None and torch.device(device).type == "meta":
        return
    module.to_empty(device=device if device is not None else "cpu")
    if dtype is not None:
        module.to(dtype=dtype)
    module.reset_parameters()


def _empty_like_dense(dense: nn.Module, module: nn.Module) -> None:
    """Gives ``module`` (built on meta) storage on ``dense``'s device and dtype."""
    weight = next(dense.parameters())
    module.to_empty(device=weight.device)
    module.to(dtype=weight.dtype)


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
        self.group = _group(group)
        self._register_layouts()

    def _register_layouts(self) -> None:
        for param in self.parameters(recurse=False):
            _C.set_layout(param, None, self.group.group_name)  # replicated

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        norm = ops.layer_norm if torch.compiler.is_compiling() else _C.layer_norm
        return norm(
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


class ParallelSelfAttention(SharesGroup, nn.Module):
    """Multi-head self-attention with the heads split across the tensor-parallel group.

    A column-parallel QKV projection (this rank's heads of Q, K and V), attention over the local
    heads, a row-parallel output projection: one all-reduce forward and one backward (a gather
    and a reduce-scatter under sequence parallelism). Equals ``nn.MultiheadAttention`` applied
    as self-attention (``attn(x, x, x)``) on ``[s, b, h]`` input.

    Args:
        hidden_size: Embedding size ``h``; divisible by ``num_heads``.
        num_heads: Attention heads in all; divisible by the group size.
        bias: Biases on the projections.
        dropout: Dropout on the attention probabilities (training only; per-rank stream of
            :mod:`torch_mp.random` when seeded there).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = _group(group)
        self.tp_size = dist.get_world_size(self.group)
        _C.check_parallel_self_attention(
            hidden_size, num_heads, bias, dropout, sequence_parallel, self.group.group_name
        )
        self.hidden_size, self.num_heads, self.dropout = hidden_size, num_heads, dropout
        self.sequence_parallel = sequence_parallel
        self.qkv, self.proj = _column_row_pair(
            (hidden_size, 3 * hidden_size),
            (hidden_size, hidden_size),
            bias,
            sequence_parallel,
            self.group,
        )
        self.qkv._layout_parts = 3  # this rank's rows of Q, of K and of V
        _materialise(self, device, dtype)

    # Parameter names in the dense counterpart (to_dense), by prefix (torch_mp.checkpoint).
    DENSE_NAMES = {"qkv.": "in_proj_", "proj.": "out_proj."}

    def reset_parameters(self) -> None:
        """Draws an ``nn.MultiheadAttention`` (as it initialises itself) and keeps our heads."""
        self.load_dense(
            nn.MultiheadAttention(self.hidden_size, self.num_heads, bias=self.qkv.bias is not None)
        )

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
        not attend) or float (added); ``is_causal`` without a mask applies the causal mask.
        Key padding masks are not supported (fold them into ``attn_mask``)."""
        dropout = self.dropout if self.training else 0.0
        if torch.compiler.is_compiling():
            t = self.tp_size
            rank = dist.get_rank(self.group)
            name = self.group.group_name
            context = ops.attention_heads(
                self.qkv(x), self.num_heads, name, t, rank, attn_mask, is_causal, dropout
            )
        else:
            context = _C.attention_heads(
                self.qkv(x), self.num_heads, self.group.group_name, attn_mask, is_causal, dropout
            )
        return self.proj(context)

    @classmethod
    def from_dense(
        cls,
        attention: nn.MultiheadAttention,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> ParallelSelfAttention:
        """Shards ``attention`` (device and dtype kept, no random draws)."""
        layer = cls(
            attention.embed_dim,
            attention.num_heads,
            bias=attention.in_proj_bias is not None,
            dropout=attention.dropout,
            sequence_parallel=sequence_parallel,
            group=group,
            device="meta",
        )
        _empty_like_dense(attention, layer)
        layer.load_dense(attention)
        return layer

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


class ParallelMLP(SharesGroup, nn.Module):
    """``fc2(dropout(activation(fc1(x))))`` with ``fc1`` column- and ``fc2`` row-parallel.

    Args:
        hidden_size: Input and output size.
        ffn_hidden_size: Inner size; divisible by the group size.
        bias: Biases on both layers.
        activation: ``"gelu"`` or ``"relu"``.
        dropout: Dropout after the activation (training only; per-rank stream).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        activation: str = "gelu",
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = _group(group)
        _C.check_parallel_mlp(
            hidden_size,
            ffn_hidden_size,
            bias,
            activation,
            dropout,
            sequence_parallel,
            self.group.group_name,
        )
        self.activation, self.dropout = activation, dropout
        self.fc1, self.fc2 = _column_row_pair(
            (hidden_size, ffn_hidden_size),
            (ffn_hidden_size, hidden_size),
            bias,
            sequence_parallel,
            self.group,
        )
        _materialise(self, device, dtype)

    def reset_parameters(self) -> None:
        """Draws fc1 then fc2 as two ``nn.Linear`` layers would be drawn."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def load_dense(self, fc1: nn.Linear | MLP, fc2: nn.Linear | None = None) -> None:
        """Copies this rank's shards of a :class:`torch_mp.dense.MLP` (or of its dense pair
        ``fc1, fc2``) into the parameters."""
        if isinstance(fc1, MLP):
            fc1, fc2 = fc1.fc1, fc1.fc2
        name = self.group.group_name
        _C.load_dense_linear_(self.fc1.weight, self.fc1.bias, fc1.weight, fc1.bias, 0, name)
        _C.load_dense_linear_(self.fc2.weight, self.fc2.bias, fc2.weight, fc2.bias, 1, name)

    def to_dense(self) -> MLP:
        """Gathers the shards into a :class:`torch_mp.dense.MLP` on every rank (a collective)."""
        mlp = MLP(
            self.fc1.in_features,
            self.fc1.out_features,
            bias=self.fc1.bias is not None,
            activation=self.activation,
            dropout=self.dropout,
        )
        mlp.fc1, mlp.fc2 = self.fc1.to_dense(), self.fc2.to_dense()
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        core = ops if torch.compiler.is_compiling() else _C
        inner = core.activation(self.fc1(x), self.activation)
        return self.fc2(core.region_dropout(inner, self.dropout, self.training))

    @classmethod
    def from_dense(
        cls, mlp: MLP, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False
    ) -> ParallelMLP:
        """Shards a :class:`torch_mp.dense.MLP` (device and dtype kept, no random draws)."""
        layer = cls(
            mlp.fc1.in_features,
            mlp.fc1.out_features,
            bias=mlp.fc1.bias is not None,
            activation=mlp.activation,
            dropout=mlp.dropout.p,
            sequence_parallel=sequence_parallel,
            group=group,
            device="meta",
        )
        _empty_like_dense(mlp, layer)
        layer.load_dense(mlp.fc1, mlp.fc2)
        return layer


class ParallelTransformerLayer(SharesGroup, nn.Module):
    """A transformer encoder layer with tensor-parallel attention and MLP.

    The same layer as ``nn.TransformerEncoderLayer`` (same arguments and defaults, ``[s, b, h]``
    layout): post-LN ``norm2(y + mlp(y))`` with ``y = norm1(x + attn(x))``, or pre-LN with
    ``norm_first=True``. With ``sequence_parallel=True`` the LayerNorms, dropouts and residuals
    act on each rank's ``s / t`` rows, and the replicated LayerNorm parameters get the dense
    gradients (see :class:`LayerNorm`).

    Args:
        hidden_size, num_heads, ffn_hidden_size: ``d_model``, ``nhead``, ``dim_feedforward``.
        dropout, activation, layer_norm_eps, norm_first, bias: As in
            ``nn.TransformerEncoderLayer`` (activation ``"relu"`` or ``"gelu"``).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``num_heads`` or ``ffn_hidden_size`` is not divisible by the group size,
            or ranks disagree on the configuration.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int = 2048,
        dropout: float = 0.1,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
        norm_first: bool = False,
        bias: bool = True,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = _group(group)
        # What the attention and MLP do not check themselves.
        _C.check_parallel_transformer_layer(norm_first, layer_norm_eps, self.group.group_name)
        self.norm_first, self.dropout, self.sequence_parallel = (
            norm_first,
            dropout,
            sequence_parallel,
        )
        self.activation = activation
        meta = {"group": self.group, "device": "meta"}
        norm_args = (hidden_size, layer_norm_eps, True, bias, sequence_parallel)
        self.norm1 = LayerNorm(*norm_args, **meta)
        self.self_attn = ParallelSelfAttention(
            hidden_size, num_heads, bias, dropout, sequence_parallel, **meta
        )
        self.norm2 = LayerNorm(*norm_args, **meta)
        self.mlp = ParallelMLP(
            hidden_size, ffn_hidden_size, bias, activation, dropout, sequence_parallel, **meta
        )
        _materialise(self, device, dtype)

    def _dense_layer(self, device=None) -> nn.TransformerEncoderLayer:
        """An ``nn.TransformerEncoderLayer`` with this layer's arguments (drawn as it draws
        itself; on ``"meta"`` for a shape to fill)."""
        return nn.TransformerEncoderLayer(
            self.self_attn.hidden_size,
            self.self_attn.num_heads,
            self.mlp.fc1.out_features,
            self.dropout,
            self.activation,
            self.norm1.eps,
            norm_first=self.norm_first,
            bias=self.mlp.fc1.bias is not None,
            device=device,
        )

    def reset_parameters(self) -> None:
        """Draws an ``nn.TransformerEncoderLayer`` with these arguments and keeps our part."""
        self.load_dense(self._dense_layer())

    def load_dense(self, layer: nn.TransformerEncoderLayer) -> None:
        """Copies this rank's part of ``layer`` into the parameters."""
        self.self_attn.load_dense(layer.self_attn)
        self.mlp.load_dense(layer.linear1, layer.linear2)
        with torch.no_grad():
            for mine, dense in ((self.norm1, layer.norm1), (self.norm2, layer.norm2)):
                mine.weight.copy_(dense.weight)
                if mine.bias is not None:
                    mine.bias.copy_(dense.bias)

    # Parameter names in the dense counterpart (to_dense), by prefix (torch_mp.checkpoint).
    DENSE_NAMES = {
        "self_attn.qkv.": "self_attn.in_proj_",
        "self_attn.proj.": "self_attn.out_proj.",
        "mlp.fc1.": "linear1.",
        "mlp.fc2.": "linear2.",
    }

    def to_dense(self) -> nn.TransformerEncoderLayer:
        """Gathers the layer into an ``nn.TransformerEncoderLayer`` on every rank (a
        collective)."""
        layer = self._dense_layer(device="meta")
        weight = self.norm1.weight
        layer.to_empty(device=weight.device)
        layer.to(dtype=weight.dtype)
        with torch.no_grad():
            layer.self_attn.load_state_dict(self.self_attn.to_dense().state_dict())
            layer.linear1.load_state_dict(self.mlp.fc1.to_dense().state_dict())
            layer.linear2.load_state_dict(self.mlp.fc2.to_dense().state_dict())
            layer.norm1.load_state_dict(self.norm1.state_dict())
            layer.norm2.load_state_dict(self.norm2.state_dict())
        return layer

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Sequence-parallel rows differ between ranks: the per-rank stream. Whole tensors are the
        # same on every rank: the shared (default) stream.
        if self.sequence_parallel:
            core = ops if torch.compiler.is_compiling() else _C
            return core.region_dropout(x, self.dropout, self.training)
        return F.dropout(x, self.dropout, self.training)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """``x``: ``[s, b, h]`` (``[s / t, b, h]`` under sequence parallelism); the mask as in
        :meth:`ParallelSelfAttention.forward`."""
        if self.norm_first:
            x = x + self._dropout(self.self_attn(self.norm1(x), attn_mask, is_causal))
            return x + self._dropout(self.mlp(self.norm2(x)))
        x = self.norm1(x + self._dropout(self.self_attn(x, attn_mask, is_causal)))
        return self.norm2(x + self._dropout(self.mlp(x)))

    @classmethod
    def from_dense(
        cls,
        layer: nn.TransformerEncoderLayer,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> ParallelTransformerLayer:
        """Shards an ``nn.TransformerEncoderLayer`` (device and dtype kept, no random draws).

        The parallel layer takes ``[s, b, h]`` whatever the dense layer's ``batch_first``.
        """
        kinds = {1: "relu", 2: "gelu"}
        approximate = (
            isinstance(layer.activation, nn.GELU) and layer.activation.approximate != "none"
        )
        if layer.activation_relu_or_gelu not in kinds or approximate:
            raise ValueError(
                "ParallelTransformerLayer: only relu and (exact) gelu activations are supported"
            )
        parallel = cls(
            layer.self_attn.embed_dim,
            layer.self_attn.num_heads,
            layer.linear1.out_features,
            dropout=layer.dropout.p,
            activation=kinds[layer.activation_relu_or_gelu],
            layer_norm_eps=layer.norm1.eps,
            norm_first=layer.norm_first,
            bias=layer.linear1.bias is not None,
            sequence_parallel=sequence_parallel,
            group=group,
            device="meta",
        )
        _empty_like_dense(layer, parallel)
        parallel.load_dense(layer)
        return parallel


class ChannelParallelBatchNorm2d(SharesGroup, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` over this rank's channels: between a column- and a row-parallel
    convolution, each rank normalises the channels it holds (their statistics need no
    communication). Parameters and running statistics are recorded as sharded along dim 0.

    Args:
        num_features: This rank's channels (the dense norm's divided by the group size).
        group: The tensor-parallel group; the default mesh's when None.
        **kwargs: As for ``nn.BatchNorm2d``.
    """

    def __init__(self, num_features: int, group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.group = _group(group)
        self._register_layouts()

    def _register_layouts(self) -> None:
        for tensor in (self.weight, self.bias, self.running_mean, self.running_var):
            if tensor is not None:
                _C.set_layout(tensor, 0, self.group.group_name)

    @classmethod
    def from_dense(
        cls, norm: nn.BatchNorm2d, group: dist.ProcessGroup | None = None
    ) -> ChannelParallelBatchNorm2d:
        """This rank's channels of ``norm`` (device and dtype kept)."""
        group = _group(group)
        t = dist.get_world_size(group)
        if norm.num_features % t:
            raise ValueError(
                f"ChannelParallelBatchNorm2d: num_features ({norm.num_features}) must be "
                f"divisible by the tensor-parallel size ({t})"
            )
        layer = cls(
            norm.num_features // t,
            group,
            eps=norm.eps,
            momentum=norm.momentum,
            affine=norm.affine,
            track_running_stats=norm.track_running_stats,
            device="meta",
        )
        _empty_like_dense(norm, layer)
        layer.load_dense(norm)
        return layer

    def load_dense(self, norm: nn.BatchNorm2d) -> None:
        """Copies this rank's channels of ``norm``: parameters and running statistics."""
        with torch.no_grad():
            for key in ("weight", "bias", "running_mean", "running_var"):
                if getattr(self, key) is not None:
                    getattr(self, key).copy_(_C.shard(getattr(norm, key), 0, self.group.group_name))
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.copy_(norm.num_batches_tracked)

    def to_dense(self) -> nn.BatchNorm2d:
        """The dense ``nn.BatchNorm2d`` on every rank (a collective over the group)."""
        t = dist.get_world_size(self.group)
        floats = [x for x in (*self.parameters(), *self.buffers()) if x.is_floating_point()]
        dense = nn.BatchNorm2d(
            self.num_features * t,
            eps=self.eps,
            momentum=self.momentum,
            affine=self.affine,
            track_running_stats=self.track_running_stats,
        )
        if floats:
            dense.to(device=floats[0].device, dtype=floats[0].dtype)
        with torch.no_grad():
            for key in ("weight", "bias", "running_mean", "running_var"):
                local = getattr(self, key)
                if local is not None:
                    gathered = _C.gather_from_tp(local.detach(), self.group.group_name, 0)
                    getattr(dense, key).copy_(gathered)
            if self.num_batches_tracked is not None:
                dense.num_batches_tracked.copy_(self.num_batches_tracked)
        return dense


class ParallelConvBlock(SharesGroup, nn.Module):
    """``conv2(relu(norm(conv1(x))))`` with the middle channels split across the group.

    ``conv1`` is a :class:`ColumnParallelConv2d` (in -> mid), ``norm`` a ``BatchNorm2d`` over this
    rank's ``mid / t`` channels (BatchNorm acts per channel, so its shard is exact, running
    statistics included), ``conv2`` a :class:`RowParallelConv2d` (mid -> out): one all-reduce
    forward, one backward. Equals :class:`torch_mp.dense.ConvBlock`.

    Raises:
        RuntimeError: If ``mid_channels`` is not divisible by the group size.
    """

    def __init__(
        self,
        in_channels: int,
        mid_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        padding: int | None = None,
        bias: bool = True,
        group: dist.ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = _group(group)
        padding = kernel_size // 2 if padding is None else padding
        _C.check_parallel_conv_block(
            in_channels,
            mid_channels,
            out_channels,
            kernel_size,
            padding,
            bias,
            self.group.group_name,
        )
        conv = {"padding": padding, "bias": bias, "group": self.group, "device": "meta"}
        self.conv1 = ColumnParallelConv2d(in_channels, mid_channels, kernel_size, **conv)
        self.norm = ChannelParallelBatchNorm2d(
            mid_channels // dist.get_world_size(self.group), self.group, device="meta"
        )
        self.conv2 = RowParallelConv2d(mid_channels, out_channels, kernel_size, **conv)
        _materialise(self, device, dtype)

    def reset_parameters(self) -> None:
        """Draws conv1 then conv2 as ``nn.Conv2d`` layers would be drawn."""
        self.conv1.reset_parameters()
        self.norm.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.norm(self.conv1(x))))

    @classmethod
    def from_dense(
        cls, block: ConvBlock, group: dist.ProcessGroup | None = None
    ) -> ParallelConvBlock:
        """Shards a :class:`torch_mp.dense.ConvBlock` (device and dtype kept, no random draws)."""
        parallel = cls(
            block.conv1.in_channels,
            block.conv1.out_channels,
            block.conv2.out_channels,
            block.conv1.kernel_size[0],
            block.conv1.padding[0],
            block.conv1.bias is not None,
            group,
            device="meta",
        )
        parallel.norm.eps, parallel.norm.momentum = block.norm.eps, block.norm.momentum
        _empty_like_dense(block, parallel)
        parallel.load_dense(block)
        return parallel

    def load_dense(self, block: ConvBlock) -> None:
        """Copies this rank's channels of ``block`` (convolutions, BatchNorm parameters and
        running statistics) into this block."""
        name = self.group.group_name
        for mine, dense, dim in ((self.conv1, block.conv1, 0), (self.conv2, block.conv2, 1)):
            _C.load_dense_linear_(mine.weight, mine.bias, dense.weight, dense.bias, dim, name)
        self.norm.load_dense(block.norm)

    def to_dense(self) -> ConvBlock:
        """Gathers the block into a :class:`torch_mp.dense.ConvBlock` on every rank (a
        collective), BatchNorm running statistics included."""
        conv1 = self.conv1.to_dense()
        block = ConvBlock(
            conv1.in_channels,
            conv1.out_channels,
            self.conv2.out_channels,
            conv1.kernel_size[0],
            conv1.padding[0],
            conv1.bias is not None,
        )
        block.conv1, block.norm, block.conv2 = conv1, self.norm.to_dense(), self.conv2.to_dense()
        return block
