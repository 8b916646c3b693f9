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

import fnmatch

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_mp._C import LayoutError
from torch_mp.mesh import Mesh, get_mesh
from torch_mp.parallelize.experts import ExpertParallel
from torch_mp.parallelize.plans import (
    LLAMA_PLAN,
    MIXTRAL_PLAN,
    RESNET_BASIC_BLOCK_PLAN,
    Plan,
    default_plan,
    prefixed,
)
from torch_mp.parallelize.styles import (
    AttentionParallel,
    ChannelParallelNorm,
    ColwiseParallel,
    LocalAttributes,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallelNorm,
    TransformerLayerParallel,
    VocabParallel,
)

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
            raise LayoutError(
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
