"""The styles of :func:`torch_mp.parallelize`: each turns a dense module into its
tensor-parallel twin (``apply(module, group)``), from this rank's shard of the module's own
weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torch_mp.tensor_parallel.attention import ParallelSelfAttention
from torch_mp.tensor_parallel.conv import ColumnParallelConv2d, RowParallelConv2d
from torch_mp.tensor_parallel.conv_block import ChannelParallelBatchNorm2d
from torch_mp.tensor_parallel.embedding import VocabParallelEmbedding
from torch_mp.tensor_parallel.layer_norm import LayerNorm
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from torch_mp.tensor_parallel.transformer_layer import ParallelTransformerLayer


class ParallelStyle:
    """How one module becomes tensor-parallel: :meth:`apply` returns its replacement.
    ``TAKES`` (module types) and :meth:`check` refuse modules it does not fit, before
    :func:`parallelize` changes anything. ``GROUP`` names the mesh's group the style splits
    over (``"tp_group"``; ``"ep_group"`` for experts): ``check`` and ``apply`` receive it."""

    TAKES: tuple[type, ...] = ()
    GROUP: str = "tp_group"

    def check(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        if self.TAKES and not isinstance(module, self.TAKES):
            self._refuse(module, " and ".join(f"nn.{t.__name__}" for t in self.TAKES))

    def apply(self, module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement apply(module, group)")

    def _refuse(self, module: nn.Module, takes: str) -> None:
        raise TypeError(f"{type(self).__name__} applies to {takes}, not {type(module).__name__}")


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Output features (channels) split; ``gather_output`` all-gathers them after."""

    gather_output: bool = False
    sequence_parallel: bool = False
    TAKES = (nn.Linear, nn.Conv2d)

    def check(self, module, group):
        ParallelStyle.check(self, module, group)
        if self.sequence_parallel and not isinstance(module, nn.Linear):
            self._refuse(module, "nn.Linear (sequence parallel)")

    def apply(self, module, group):
        if isinstance(module, nn.Linear):
            return ColumnParallelLinear.from_dense(
                module,
                group,
                gather_output=self.gather_output,
                sequence_parallel=self.sequence_parallel,
            )
        if isinstance(module, nn.Conv2d) and not self.sequence_parallel:
            return ColumnParallelConv2d.from_dense(module, group, gather_output=self.gather_output)
        self._refuse(module, "nn.Linear and nn.Conv2d (sequence parallel: nn.Linear)")


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Input features (channels) split, the output all-reduced (reduce-scattered along the
    sequence with ``sequence_parallel``); ``input_is_parallel=False`` splits a whole input."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False
    TAKES = (nn.Linear, nn.Conv2d)
    check = ColwiseParallel.check

    def apply(self, module, group):
        if isinstance(module, nn.Linear):
            return RowParallelLinear.from_dense(
                module,
                group,
                input_is_parallel=self.input_is_parallel,
                sequence_parallel=self.sequence_parallel,
            )
        if isinstance(module, nn.Conv2d) and not self.sequence_parallel:
            return RowParallelConv2d.from_dense(
                module, group, input_is_parallel=self.input_is_parallel
            )
        self._refuse(module, "nn.Linear and nn.Conv2d (sequence parallel: nn.Linear)")


@dataclass(frozen=True)
class VocabParallel(ParallelStyle):
    """An embedding's vocabulary split over the ranks (any size; the last rows padded)."""

    TAKES = (nn.Embedding,)

    def apply(self, module, group):
        if not isinstance(module, nn.Embedding):
            self._refuse(module, "nn.Embedding")
        return VocabParallelEmbedding.from_dense(module, group)


@dataclass(frozen=True)
class ChannelParallelNorm(ParallelStyle):
    """A BatchNorm over this rank's channels (after a colwise convolution)."""

    TAKES = (nn.BatchNorm2d,)

    def apply(self, module, group):
        if not isinstance(module, nn.BatchNorm2d):
            self._refuse(module, "nn.BatchNorm2d")
        return ChannelParallelBatchNorm2d.from_dense(module, group)


@dataclass(frozen=True)
class SequenceParallelNorm(ParallelStyle):
    """A LayerNorm on this rank's chunk of the sequence (its gradients summed over ranks)."""

    TAKES = (nn.LayerNorm,)

    def apply(self, module, group):
        if not isinstance(module, nn.LayerNorm):
            self._refuse(module, "nn.LayerNorm")
        return LayerNorm.from_dense(module, sequence_parallel=True, group=group)


class _MultiheadSelfAttention(ParallelSelfAttention):
    """ParallelSelfAttention called as ``nn.MultiheadAttention`` is, for self-attention:
    ``(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (output, None)``."""

    batch_first = False  # read by nn.TransformerEncoderLayer's fast-path checks
    _batch_first = False  # the dense module's: inputs [b, s, h]

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        if key is not query or value is not query:
            raise ValueError("parallelize: AttentionParallel supports self-attention only")
        if key_padding_mask is not None:
            raise ValueError(
                "parallelize: AttentionParallel does not take key_padding_mask (fold it into "
                "attn_mask)"
            )
        x = query.transpose(0, 1) if self._batch_first else query
        out = super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        return (out.transpose(0, 1) if self._batch_first else out), None


@dataclass(frozen=True)
class AttentionParallel(ParallelStyle):
    """``nn.MultiheadAttention`` (self-attention, no kdim/vdim) with its heads split. Called as
    the dense module is, it returns ``(output, None)``: attention weights are not gathered."""

    TAKES = (nn.MultiheadAttention,)

    def apply(self, module, group):
        if not isinstance(module, nn.MultiheadAttention):
            self._refuse(module, "nn.MultiheadAttention")
        attention = _MultiheadSelfAttention.from_dense(module, group)
        attention._batch_first = module.batch_first
        return attention


class _EncoderLayer(ParallelTransformerLayer):
    """ParallelTransformerLayer called as ``nn.TransformerEncoderLayer`` is."""

    _batch_first = False  # the dense layer's: inputs [b, s, h]

    def forward(  # type: ignore[override]
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if src_key_padding_mask is not None:
            raise ValueError(
                "parallelize: TransformerLayerParallel does not take src_key_padding_mask (fold "
                "it into src_mask)"
            )
        x = src.transpose(0, 1) if self._batch_first else src
        out = super().forward(x, attn_mask=src_mask, is_causal=is_causal)
        return out.transpose(0, 1) if self._batch_first else out


@dataclass(frozen=True)
class TransformerLayerParallel(ParallelStyle):
    """``nn.TransformerEncoderLayer``: heads and MLP split (with ``sequence_parallel`` also the
    norms, dropouts and residuals, on ``[s / t, b, h]`` chunks: the caller scatters the sequence
    before the first such layer and gathers it after the last, and modules between them on the
    chunks need a sequence-parallel style too, e.g. "sequence_norm" for a final LayerNorm)."""

    TAKES = (nn.TransformerEncoderLayer,)

    sequence_parallel: bool = False

    def apply(self, module, group):
        if not isinstance(module, nn.TransformerEncoderLayer):
            self._refuse(module, "nn.TransformerEncoderLayer")
        if module.self_attn.batch_first and self.sequence_parallel:
            raise ValueError("parallelize: sequence parallelism needs batch_first=False layers")
        layer = _EncoderLayer.from_dense(module, group, self.sequence_parallel)
        layer._batch_first = module.self_attn.batch_first
        layer.self_attn.batch_first = False  # read by nn.TransformerEncoder's fast-path checks
        return layer


class LocalAttributes(ParallelStyle):
    """Keeps the module and divides its integer attributes ``names`` by the group size (the
    head counts and widths a module reshapes by, once its projections are split)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def __repr__(self) -> str:
        return f"LocalAttributes{self.names!r}"

    def check(self, module, group):
        t = dist.get_world_size(group)
        for name in self.names:
            value = getattr(module, name, None)
            if not isinstance(value, int) or value % t:
                raise ValueError(
                    f"{type(module).__name__}.{name} ({value!r}) is not an integer divisible by "
                    f"the tensor-parallel size ({t})"
                )

    def apply(self, module, group):
        t = dist.get_world_size(group)
        for name in self.names:
            setattr(module, name, getattr(module, name) // t)
        return module
