"""Tensor parallelism for a model one did not write: a plan maps module names to styles, and
:func:`parallelize` swaps each named module for its tensor-parallel twin (``from_dense``: this
rank's shard of the module's own weights, no random draws)::

    plan = {
        "model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }
    model = torch_mp.parallelize(model, plan=plan)   # on every rank of the tensor group

Keys are module names or ``fnmatch`` patterns over them (``*`` matches within and across dots);
values are styles, or their names (in brackets):

- :class:`ColwiseParallel` ("colwise"): ``nn.Linear`` -> ColumnParallelLinear, ``nn.Conv2d``
  -> ColumnParallelConv2d (output features or channels split);
- :class:`RowwiseParallel` ("rowwise"): ``nn.Linear`` -> RowParallelLinear, ``nn.Conv2d`` ->
  RowParallelConv2d (input split, output all-reduced);
- :class:`VocabParallel` ("vocab"): ``nn.Embedding`` -> VocabParallelEmbedding;
- :class:`ChannelParallelNorm` ("channel_norm"): ``nn.BatchNorm2d`` ->
  ChannelParallelBatchNorm2d (this rank's channels, between a colwise and a rowwise conv);
- :class:`SequenceParallelNorm` ("sequence_norm"): ``nn.LayerNorm`` -> tensor_parallel.LayerNorm
  on this rank's chunk of the sequence;
- :class:`AttentionParallel` ("attention"): ``nn.MultiheadAttention`` (self-attention) ->
  ParallelSelfAttention, called as the dense module is;
- :class:`TransformerLayerParallel` ("transformer_layer"): ``nn.TransformerEncoderLayer`` ->
  ParallelTransformerLayer, called as the dense layer is;
- :class:`LocalAttributes` ``(*names)``: the module itself, its integer attributes ``names``
  divided by the group size;
- :class:`ExpertParallel` ("experts"): a mixture of experts with its experts split over the
  mesh's *expert* group (``mesh.ep_group``): a Hugging Face sparse MoE block (Mixtral's) -> the
  same block, its tokens sent to their experts' ranks by all-to-all; ``torch_mp.dense.MoE`` ->
  ``torch_mp.moe.MoE``.

A column layer followed by a row layer (attention's projections, an MLP) communicates once in
forward and once in backward; everything between them works on this rank's share: heads,
channels or features. Modules that reshape by a stored head count need ``LocalAttributes``
(Hugging Face's Llama reshapes by ``-1`` and needs none). With no plan, :func:`default_plan`
covers ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` wherever they are.

Ready plans: :data:`LLAMA_PLAN` (Hugging Face ``LlamaForCausalLM``), :data:`MIXTRAL_PLAN`
(``MixtralForCausalLM``: attention over the tensor group, experts over the expert group),
:data:`RESNET_BASIC_BLOCK_PLAN`
(torchvision's ``BasicBlock``; prefix it with the blocks' names, see :func:`prefixed`).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from torch_mp import dense as dense_modules
from torch_mp.mesh import Mesh, get_mesh
from torch_mp.moe import MoE
from torch_mp.tensor_parallel.attention import ParallelSelfAttention
from torch_mp.tensor_parallel.conv import ColumnParallelConv2d, RowParallelConv2d
from torch_mp.tensor_parallel.conv_block import ChannelParallelBatchNorm2d
from torch_mp.tensor_parallel.embedding import VocabParallelEmbedding
from torch_mp.tensor_parallel.layer_norm import LayerNorm
from torch_mp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from torch_mp.tensor_parallel.transformer_layer import ParallelTransformerLayer

__all__ = [
    "LLAMA_PLAN",
    "MIXTRAL_PLAN",
    "RESNET_BASIC_BLOCK_PLAN",
    "AttentionParallel",
    "ChannelParallelNorm",
    "ColwiseParallel",
    "ExpertParallel",
    "LocalAttributes",
    "ParallelStyle",
    "RowwiseParallel",
    "SequenceParallelNorm",
    "TransformerLayerParallel",
    "VocabParallel",
    "default_plan",
    "parallelize",
    "prefixed",
]


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
        raise NotImplementedError

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


class _SparseMoeBlock(MoE):
    """A Hugging Face sparse mixture-of-experts block (Mixtral's ``MixtralSparseMoeBlock``: a
    top-k softmax router ``gate`` and SiLU-gated experts stacked in ``experts.gate_up_proj`` /
    ``experts.down_proj``) with its experts split over the expert group, called as the block is:
    ``forward(hidden_states) -> hidden_states``.

    It is a :class:`torch_mp.moe.MoE` with ``activation="swiglu"`` whose router is the block's
    own ``gate`` (replicated): the gate also runs on the tokens as it does in the block, so that
    the model's router-logit recorders, and with them its load-balancing loss
    (``output_router_logits``), see what they see in the one-process model. The module's own
    load-balancing loss of the last call is kept in :attr:`aux_loss`. Checkpoints and
    :meth:`to_dense` use the block's names and form."""

    DENSE_NAMES = {
        "router.": "gate.",
        "experts.fc1_weight": "experts.gate_up_proj",
        "experts.fc2_weight": "experts.down_proj",
    }

    @classmethod
    def from_block(cls, block: nn.Module, group: dist.ProcessGroup) -> _SparseMoeBlock:
        e, rows, h = block.experts.gate_up_proj.shape
        layer = cls(h, rows // 2, e, block.top_k, activation="swiglu", group=group, device="meta")
        weight = block.gate.weight
        layer.to_empty(device=weight.device)
        layer.to(dtype=weight.dtype)
        layer.router = block.gate
        layer._register_layouts()
        # The block's form, for to_dense (a plain attribute: not a submodule), on the meta
        # device without copying its weights first.
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in block.parameters()}
        layer._block_form = (copy.deepcopy(block, memo),)
        layer.aux_loss = None
        layer.load_dense(block)
        return layer

    def reset_parameters(self) -> None:
        raise NotImplementedError(
            "a parallelized Hugging Face MoE block has no initialisation of its own: load its "
            "weights (load_dense, torch_mp.checkpoint)"
        )

    def load_dense(self, block: nn.Module) -> None:
        """Copies ``block``'s gate and this rank's experts into the parameters."""
        rank, local = dist.get_rank(self.group), self.experts.num_experts
        mine = slice(rank * local, (rank + 1) * local)
        shapes = (tuple(block.experts.gate_up_proj.shape), tuple(block.experts.down_proj.shape))
        want = (
            (local * self.ep_size, *self.experts.fc1_weight.shape[1:]),
            (local * self.ep_size, *self.experts.fc2_weight.shape[1:]),
        )
        if shapes != want:
            raise ValueError(
                f"load_dense: the block's experts are {shapes[0]} and {shapes[1]}, this module's "
                f"dense ones {want[0]} and {want[1]}"
            )
        with torch.no_grad():
            self.router.weight.copy_(block.gate.weight)
            self.experts.fc1_weight.copy_(block.experts.gate_up_proj[mine])
            self.experts.fc2_weight.copy_(block.experts.down_proj[mine])

    def to_dense(self) -> nn.Module:
        """The block, every expert gathered onto every rank (a collective)."""
        moe = super().to_dense()
        weight = self.router.weight
        block = copy.deepcopy(self._block_form[0]).to_empty(device=weight.device)
        block.to(dtype=weight.dtype)
        with torch.no_grad():
            block.gate.weight.copy_(moe.router.weight)
            block.experts.gate_up_proj.copy_(moe.experts.fc1_weight)
            block.experts.down_proj.copy_(moe.experts.fc2_weight)
        return block

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.router(hidden_states.reshape(-1, hidden_states.shape[-1]))  # for the recorders
        y, self.aux_loss = super().forward(hidden_states)
        return y


def _check_sparse_moe_block(module: nn.Module) -> None:
    """Raises unless ``module`` is laid out as Mixtral's sparse MoE block, with nothing that
    one process and the expert group would compute differently."""
    name = type(module).__name__
    parameters = {n: p for n, p in module.named_parameters()}
    if (
        set(dict(module.named_children())) != {"gate", "experts"}
        or set(parameters) != {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
        or any(True for _ in module.buffers())
        or not isinstance(getattr(module, "top_k", None), int)
    ):
        raise TypeError(
            "ExpertParallel applies to torch_mp.dense.MoE and to Hugging Face sparse MoE blocks "
            "laid out as Mixtral's (gate.weight [E, h], experts.gate_up_proj [E, 2f, h], "
            f"experts.down_proj [E, h, f] and top_k, nothing else), not {name} (whose "
            f"parameters are {sorted(parameters)})"
        )
    gate, experts = module.gate, module.experts
    if len({p.dtype for p in parameters.values()}) > 1:
        raise ValueError(f"ExpertParallel: {name}'s gate and experts differ in dtype")
    # The gate must route as Mixtral's: softmax in fp32, the top k, renormalised.
    weight = gate.weight
    probe = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight)
    with torch.no_grad():
        routed = gate(probe)
        top, chosen = F.linear(probe, weight).float().softmax(-1).topk(module.top_k, -1)
    if not (
        isinstance(routed, tuple)
        and len(routed) == 3
        and torch.equal(routed[2], chosen)
        and torch.allclose(routed[1].float(), top / top.sum(-1, keepdim=True))
    ):
        raise ValueError(
            f"ExpertParallel: {name}'s gate does not route as Mixtral's (softmax over the "
            "experts, the top k renormalised, returned as (logits, weights, indices))"
        )
    probe = torch.linspace(-3, 3, 7)
    act = getattr(experts, "act_fn", None)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(
            f"ExpertParallel: {type(module).__name__}'s experts must be SiLU-gated "
            "(hidden_act 'silu')"
        )
    if getattr(module, "jitter_noise", 0) > 0:
        raise ValueError(
            f"ExpertParallel: router_jitter_noise = {module.jitter_noise} draws noise for every "
            "token, which the expert group's ranks cannot draw as one process does; set it to 0"
        )


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    """A mixture of experts with its experts split over the mesh's expert group (rank e of the
    group holding experts ``[e E / ep, (e + 1) E / ep)``, the router replicated): a Hugging Face
    sparse MoE block laid out as Mixtral's becomes the same block, called as it is
    (SiLU-gated experts; router jitter refused); a :class:`torch_mp.dense.MoE` becomes
    :class:`torch_mp.moe.MoE`. Each rank routes its own tokens: the experts' gradients gather
    the tokens of the whole expert group, the router's are this rank's (reduce both with
    :class:`torch_mp.DataParallel`, which knows the experts' group)."""

    GROUP = "ep_group"

    def check(self, module, group):
        if group is None:
            raise ValueError(
                "ExpertParallel needs a mesh with an expert group (torch_mp.init(..., ep=N))"
            )
        if isinstance(module, dense_modules.MoE):
            experts = module.num_experts
        else:
            _check_sparse_moe_block(module)
            experts = module.experts.gate_up_proj.shape[0]
        if experts % dist.get_world_size(group):
            raise ValueError(
                f"{experts} experts cannot be split over an expert group of "
                f"{dist.get_world_size(group)} ranks"
            )

    def apply(self, module, group):
        if isinstance(module, dense_modules.MoE):
            return MoE.from_dense(module, group)
        return _SparseMoeBlock.from_block(module, group)


STYLES: dict[str, ParallelStyle] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "vocab": VocabParallel(),
    "channel_norm": ChannelParallelNorm(),
    "sequence_norm": SequenceParallelNorm(),
    "attention": AttentionParallel(),
    "transformer_layer": TransformerLayerParallel(),
    "experts": ExpertParallel(),
}

Plan = Mapping[str, "ParallelStyle | str"]

# Hugging Face LlamaForCausalLM (and models laid out alike: Mistral, Qwen2): attention heads
# and MLP split, the vocabulary of the embedding split, the head's logits gathered (a loss over
# the whole vocabulary, as the model computes it). Key/value heads must be divisible too.
LLAMA_PLAN: dict[str, ParallelStyle | str] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": ColwiseParallel(gather_output=True),
}

# Hugging Face MixtralForCausalLM: as LLAMA_PLAN's attention and vocabulary over the tensor group,
# and every layer's sparse MoE block with its experts over the expert group (each tensor rank
# runs the block on the same tokens). Needs router_jitter_noise 0 and SiLU experts.
MIXTRAL_PLAN: dict[str, ParallelStyle | str] = {
    **{k: v for k, v in LLAMA_PLAN.items() if ".mlp." not in k},
    "model.layers.*.mlp": "experts",
}

# torchvision's ResNet BasicBlock: conv1's output channels split, bn1 over them, conv2's input
# channels split and its output all-reduced; bn2 and the shortcut whole.
RESNET_BASIC_BLOCK_PLAN: dict[str, ParallelStyle | str] = {
    "conv1": "colwise",
    "bn1": "channel_norm",
    "conv2": "rowwise",
}


def prefixed(prefix: str, plan: Plan) -> dict[str, ParallelStyle | str]:
    """``plan`` for the modules under ``prefix`` (a name or pattern): ``prefixed("layer1.*",
    RESNET_BASIC_BLOCK_PLAN)`` covers every block of a ResNet's layer1."""

    def join(key: str) -> str:
        return ".".join(part for part in (prefix, key) if part)

    return {join(key): style for key, style in plan.items()}


def default_plan(model: nn.Module) -> dict[str, ParallelStyle | str]:
    """Every ``nn.TransformerEncoderLayer`` of ``model`` as a whole parallel layer, and every
    ``nn.MultiheadAttention`` outside them with its heads split."""
    plan: dict[str, ParallelStyle | str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            plan[name] = "transformer_layer"
        elif (
            isinstance(module, nn.MultiheadAttention)
            and not name.endswith("multihead_attn")  # a decoder layer's cross-attention
            and not any(name.startswith(f"{layer}.") or not layer for layer in plan)
        ):
            plan[name] = "attention"
    if not plan:
        raise ValueError(
            f"parallelize: {type(model).__name__} has no nn.TransformerEncoderLayer or "
            "nn.MultiheadAttention; give a plan"
        )
    return plan


def _inside(name: str, outer: str) -> bool:
    """Whether the module ``name`` lies strictly inside the module ``outer``."""
    return name != outer and (not outer or name.startswith(f"{outer}."))


def _style(style: ParallelStyle | str) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    if style not in STYLES:
        raise ValueError(f"parallelize: unknown style {style!r}; known: {', '.join(STYLES)}")
    return STYLES[style]


def _check_config_counts(model: nn.Module, chosen: dict, mesh: Mesh) -> None:
    """A Hugging Face model's head counts and MLP width (from its ``config``) against the
    tensor group, for the modules the plan splits: the model reshapes by them, so a split that
    is not along whole heads would fail deep inside its forward. Raises naming the module, the
    count and the sizes that would divide it. (ExpertParallel's check counts the experts.)"""
    config = next(
        (
            m.config
            for _, m in model.named_modules()
            if hasattr(getattr(m, "config", None), "num_attention_heads")
        ),
        None,
    )
    if config is None:
        return
    split = [  # the modules split over the tensor group
        n
        for n, (_, s) in chosen.items()
        if s.GROUP == "tp_group" and not isinstance(s, LocalAttributes)
    ]
    counts = []  # (module, config field, count)
    attention = [n for n in split if ".self_attn" in f"{n}."]
    if attention:
        module = attention[0].rsplit(".self_attn", 1)[0] + ".self_attn"
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        counts += [
            (module, "num_attention_heads", heads),
            (module, "num_key_value_heads", kv_heads),
        ]
    mlp = [n for n in split if ".mlp." in n]
    if mlp and isinstance(getattr(config, "intermediate_size", None), int):
        counts.append((mlp[0], "intermediate_size", config.intermediate_size))
    for module, field, count in counts:
        if count % mesh.tp_size:
            fitting = [t for t in range(1, count + 1) if all(c % t == 0 for _, _, c in counts)]
            raise ValueError(
                f"parallelize: {module!r}: the model's config.{field} ({count}) is not divisible "
                f"by the tensor-parallel size ({mesh.tp_size}); tensor-parallel sizes that "
                f"divide every count the plan splits: {fitting}"
            )


def _check_not_wrapped(model: nn.Module) -> None:
    """A model already in a data-parallel wrapper: parallelize would replace the parameters the
    wrapper averages with new ones it knows nothing of, left un-averaged."""
    for name, module in model.named_modules():
        wrapper = getattr(module, "_torch_mp_wrapped_by", None) or (
            "DistributedDataParallel" if isinstance(module, DistributedDataParallel) else None
        )
        if wrapper is not None:
            raise ValueError(
                f"parallelize: {type(model).__name__}"
                f"{f' (its module {name!r})' if name else ''} is already wrapped in {wrapper}, "
                "which holds its parameters as they are now; parallelize first, then wrap: "
                "torch_mp.DataParallel(torch_mp.parallelize(model, mesh, plan), mesh=mesh)"
            )


def parallelize(model: nn.Module, mesh: Mesh | None = None, plan: Plan | None = None) -> nn.Module:
    """Makes ``model`` tensor-parallel over ``mesh``'s tensor group (the default mesh's) by
    ``plan`` (module name or pattern -> style; :func:`default_plan` when None), in place; the
    "experts" style splits over the mesh's expert group instead.
    Call it on every rank of the group with the same model (the same weights: each rank keeps
    its shard).

    Returns:
        ``model`` (or its replacement, if the plan names the root ``""``).

    Raises:
        ValueError: If ``model`` is already in ``DataParallel`` (or DDP): wrap after
            parallelizing. If a plan entry matches no module, a module is matched twice or lies
            inside another that is replaced, a style does not fit its module (naming it), or a
            Hugging Face model's config has head, key/value head or MLP width counts the
            tensor group does not divide (naming the module, the count and the sizes that would).
    """
    mesh = mesh or get_mesh()
    _check_not_wrapped(model)
    plan = default_plan(model) if plan is None else plan
    names = [name for name, _ in model.named_modules()]
    chosen: dict[str, tuple[str, ParallelStyle]] = {}
    for pattern, style in plan.items():
        matched = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        # "*" crosses dots: of the modules one pattern matches, the outermost are meant.
        matched = [n for n in matched if not any(_inside(n, m) for m in matched)]
        if not matched:
            raise ValueError(
                f"parallelize: plan entry {pattern!r} matches no module of {type(model).__name__}"
            )
        for name in matched:
            if name in chosen:
                raise ValueError(
                    f"parallelize: {name!r} is matched by both {chosen[name][0]!r} and {pattern!r}"
                )
            chosen[name] = (pattern, _style(style))
    replaced = [n for n, (_, s) in chosen.items() if not isinstance(s, LocalAttributes)]
    for name in chosen:
        outer = [r for r in replaced if _inside(name, r)]
        if outer:
            raise ValueError(f"parallelize: {name!r} lies inside {outer[0]!r}, which is replaced")
    # Everything is checked before anything changes.
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    for name in replaced:
        module = model.get_submodule(name)
        for param in module.parameters():
            elsewhere = [o for o in owners[id(param)] if o != name and not _inside(o, name)]
            if elsewhere:
                raise ValueError(
                    f"parallelize: {name!r} shares a parameter with {elsewhere[0]!r} (tied "
                    "weights): its shard would no longer be that module's; untie them first"
                )
    for name, (pattern, style) in chosen.items():
        try:
            style.check(model.get_submodule(name), getattr(mesh, style.GROUP))
        except (TypeError, ValueError) as e:
            raise type(e)(f"parallelize: {name!r} (plan entry {pattern!r}): {e}") from e
    _check_config_counts(model, chosen, mesh)
    for name, (pattern, style) in chosen.items():
        module = model.get_submodule(name)
        try:
            new = style.apply(module, getattr(mesh, style.GROUP))
        except (TypeError, ValueError, RuntimeError) as e:
            raise type(e)(f"parallelize: {name!r} (plan entry {pattern!r}): {e}") from e
        if new is module:
            continue
        if not name:
            model = new
            continue
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, new)
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False  # its fast path reads the dense layers' weights
    return model
