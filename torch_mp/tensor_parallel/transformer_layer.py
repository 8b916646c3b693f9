"""A transformer encoder layer with tensor-parallel attention and MLP (the C++ core's
csrc/torch_mp/tensor_parallel/transformer_layer.h). Its forward, the residual order, the norms
and which dropout draws from which stream, is the core's: the operator
``torch.ops.torch_mp.parallel_transformer_layer``."""

from __future__ import annotations

import torch
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.context_parallel.sharding import _context_group
from torch_mp.mesh import tp_group_or_default
from torch_mp.tensor_parallel._shell import empty_like_dense, materialise
from torch_mp.tensor_parallel.attention import ParallelSelfAttention
from torch_mp.tensor_parallel.layer_norm import LayerNorm
from torch_mp.tensor_parallel.mlp import ParallelMLP


class ParallelTransformerLayer(
    DeclaredOptions, SharesGroup, nn.Module, declared="ParallelTransformerLayer"
):
    """A transformer encoder layer with tensor-parallel attention and MLP.

    The same layer as ``nn.TransformerEncoderLayer`` (same arguments and defaults, ``[s, b, h]``
    layout): post-LN ``norm2(y + mlp(y))`` with ``y = norm1(x + attn(x))``, or pre-LN with
    ``norm_first=True``. With ``sequence_parallel=True`` the LayerNorms, dropouts and residuals
    act on each rank's ``s / t`` rows, and the replicated LayerNorm parameters get the dense
    gradients (see :class:`LayerNorm`). With ``context_parallel=True`` each rank holds its part
    of the sequence (cut by :func:`torch_mp.context_parallel.shard_sequence`) and only the
    attention meets the other parts (:class:`ParallelSelfAttention`); the parameters are
    replicated over the context group, their gradients reduced over data x context ranks by
    :class:`torch_mp.DataParallel`.

    Args (the options the C++ core declares, csrc/torch_mp/tensor_parallel/transformer_layer.h):
        hidden_size, num_heads, ffn_hidden_size: ``d_model``, ``nhead``, ``dim_feedforward``.
        dropout, activation, layer_norm_eps, norm_first, bias: As in
            ``nn.TransformerEncoderLayer`` (activation ``"relu"`` or ``"gelu"``).
        sequence_parallel: Input and output split along the sequence dim 0.
        group: The tensor-parallel group; the default mesh's when None.
        recompute: Activation recomputation. ``""`` (or None) keeps every activation for the
            backward;
            ``"full"`` keeps the layer's input only and runs the whole layer again in the
            backward; ``"selective"`` recomputes the attention core only (scores, softmax,
            dropout and the product with V, the activations that grow with ``s**2``; Megatron's
            ``--recompute-granularity selective``). Both replay the dropout masks (as
            :func:`torch_mp.recompute`), so the gradients equal those without recomputation, and
            both compose with the pipeline's schedules, the zero-bubble split included (one
            recomputation per backward, each gradient computed once).
        context_parallel, context_group, context_method, load_balance: Context parallelism, as
            in :class:`ParallelSelfAttention`. Dropout is refused in training under it (the
            ranks' masks could not be those one process draws): pass ``dropout=0``.
        softmax_scale: The attention's, as in :class:`ParallelSelfAttention`.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``num_heads`` or ``ffn_hidden_size`` is not divisible by the group size,
            ``recompute`` is none of the above, or ranks disagree on the configuration.
    """

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        self._take_options(args, kwargs, group=tp_group_or_default)
        if self.context_parallel:  # resolved once, here, for the attention too
            self.context_group = _context_group(self.context_group)
        # What the attention and MLP do not check themselves.
        self._check_options(self.options())
        children = self._children(
            norm1=LayerNorm, self_attn=ParallelSelfAttention, norm2=LayerNorm, mlp=ParallelMLP
        )
        self.norm1 = LayerNorm(**children["norm1"], device="meta")
        self.self_attn = ParallelSelfAttention(**children["self_attn"], device="meta")
        self.norm2 = LayerNorm(**children["norm2"], device="meta")
        self.mlp = ParallelMLP(**children["mlp"], device="meta")
        materialise(self, device, dtype)

    def _dense_layer(self, device=None) -> nn.TransformerEncoderLayer:
        """An ``nn.TransformerEncoderLayer`` with this layer's arguments (drawn as it draws
        itself; on ``"meta"`` for a shape to fill)."""
        return nn.TransformerEncoderLayer(
            self.hidden_size,
            self.num_heads,
            self.ffn_hidden_size,
            self.dropout,
            self.activation,
            self.layer_norm_eps,
            norm_first=self.norm_first,
            bias=self.bias,
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

    # Parameter names in the dense counterpart (to_dense), by prefix (torch_mp.checkpoint): the
    # C++ module's table.
    DENSE_NAMES = dict(_C.dense_names("ParallelTransformerLayer"))

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

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """``x``: ``[s, b, h]`` (``[s / t, b, h]`` under sequence parallelism; ``s`` this
        rank's part under context parallelism); the mask as in
        :meth:`ParallelSelfAttention.forward`."""
        attention, mlp = self.self_attn, self.mlp
        return torch.ops.torch_mp.parallel_transformer_layer(
            x,
            self.norm1.weight,
            self.norm1.bias,
            attention.qkv.weight,
            attention.qkv.bias,
            attention.proj.weight,
            attention.proj.bias,
            self.norm2.weight,
            self.norm2.bias,
            mlp.fc1.weight,
            mlp.fc1.bias,
            mlp.fc2.weight,
            mlp.fc2.bias,
            attn_mask,
            is_causal,
            self.training,
            **self._operator_options(),
        )

    _FROM_DENSE_POSITIONAL = ("group", "sequence_parallel", "recompute")

    @classmethod
    def from_dense(
        cls, layer: nn.TransformerEncoderLayer, *args, **kwargs
    ) -> ParallelTransformerLayer:
        """Shards an ``nn.TransformerEncoderLayer`` (device and dtype kept, no random draws).

        The parallel layer takes ``[s, b, h]`` whatever the dense layer's ``batch_first``;
        ``group``, ``sequence_parallel`` and ``recompute`` (by position or keyword) and the
        context options as the constructor's.
        """
        kinds = {1: "relu", 2: "gelu"}
        approximate = (
            isinstance(layer.activation, nn.GELU) and layer.activation.approximate != "none"
        )
        if layer.activation_relu_or_gelu not in kinds or approximate:
            raise ValueError(
                "ParallelTransformerLayer: only relu and (exact) gelu activations are supported"
            )
        taken = {
            "hidden_size": layer.self_attn.embed_dim,
            "num_heads": layer.self_attn.num_heads,
            "ffn_hidden_size": layer.linear1.out_features,
            "dropout": layer.dropout.p,
            "activation": kinds[layer.activation_relu_or_gelu],
            "layer_norm_eps": layer.norm1.eps,
            "norm_first": layer.norm_first,
            "bias": layer.linear1.bias is not None,
        }
        parallel = cls._from_dense(layer, args, kwargs, taken)
        empty_like_dense(layer, parallel)
        parallel.load_dense(layer)
        return parallel
