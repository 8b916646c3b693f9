"""Know before you launch: what a layout costs each rank (docs/plan.md).

:func:`estimate` counts, from the model's shapes, the bytes each kind of rank holds (parameters,
gradients, optimizer state, activations, communication buffers) and its peak, with the FLOPs
and bytes sent of a step; the C++ core computes it (``torch_mp::plan::estimate``), by the rules
the layers, DataParallel, the distributed optimizer and the pipeline's schedules follow.
:func:`measure` trains the layout on the current ranks and returns what a rank really allocated,
the number the estimate is tested against. With a :class:`Machine`, the estimate's ``time`` is
the step's (:func:`measure_time` measures it); :func:`search` (and ``python -m torch_mp.plan``)
picks the fastest layouts that fit.
"""

from __future__ import annotations

import torch

from torch_mp import _C
from torch_mp._C import LayoutError
from torch_mp.plan.layout import Layout, as_layout, mesh_sizes
from torch_mp.plan.machine import Machine, parse_bytes
from torch_mp.plan.measure import measure, measure_time
from torch_mp.plan.module import trace_module, vocab_of
from torch_mp.plan.search import Candidate, NothingFits, search
from torch_mp.plan.trace import DECODERS, MOE_DECODERS, trace

__all__ = [
    "Candidate",
    "Estimate",
    "Layout",
    "LayoutError",
    "Machine",
    "RankEstimate",
    "StepTime",
    "estimate",
    "measure",
    "measure_time",
    "NothingFits",
    "parse_bytes",
    "search",
]

#: One row of an estimate (``torch_mp::plan::RankEstimate``): ``kind`` ("every rank", "first
#: stage", "middle stages", "last stage"), ``pipeline_ranks``, and bytes: ``parameters``,
#: ``gradients``, ``optimizer_state``, ``communication_buffers`` (``persistent_buffers`` of them
#: kept between steps), ``activations_per_microbatch``, ``microbatches_in_flight``,
#: ``activations`` (at the peak), ``accumulating_gradients``, ``peak`` and ``between_steps``.
RankEstimate = _C.RankEstimate
#: ``ranks`` (a list of :data:`RankEstimate`), ``flops_per_rank``, ``bytes_sent`` (per dimension,
#: per rank and step), ``time`` (a :data:`StepTime`, with a ``machine``; else absent); ``str()``
#: is a table.
Estimate = _C.Estimate
#: A step's time on a :class:`Machine` (``torch_mp::plan::StepTime``), seconds: ``seconds`` (one
#: optimizer step), ``forward`` and ``backward`` (one micro-batch through the busiest stage),
#: ``pipeline`` (the schedule's makespan), ``bubble_fraction``, ``data_parallel`` (traffic the
#: backward does not hide), ``optimizer``, ``communication`` (per dimension, before overlap); and
#: ``tokens_per_second`` of the whole job.
StepTime = _C.StepTime


_TRACES: dict = {}  # traces by (config, tp, ep, load, micro_batch, seq_len, dtype), oldest first


def _shape(model, layout: Layout):
    """The core's model arguments: the sizes, for a Hugging Face decoder its trace, and the
    experts each token is routed to."""
    from torch_mp.models import GPTConfig

    config = getattr(model, "config", model)  # (a DenseGPT's or a Hugging Face model's)
    if isinstance(config, GPTConfig):
        sizes = (config.vocab, config.seq, config.hidden, config.heads, config.ffn)
        return (*sizes, config.layers, config.moe_experts), None, config.moe_top_k
    kind = getattr(config, "model_type", None)
    if kind in DECODERS:
        experts = getattr(config, "num_local_experts", 0) if kind in MOE_DECODERS else 0
        top_k = getattr(config, "num_experts_per_tok", 2)
        tp, ep, dtype = layout.tp, layout.ep, layout.dtype
        load = _C.plan_expert_load(top_k, layout) if experts else 1.0
        key = (config.to_json_string(), tp, ep, load, layout.micro_batch, layout.seq_len, dtype)
        if key not in _TRACES:  # (the planner estimates many layouts of one trace)
            if len(_TRACES) >= 64:
                _TRACES.pop(next(iter(_TRACES)))
            _TRACES[key] = trace(
                config, tp=tp, **_sizes(layout), dtype=dtype, ep=ep, expert_load=load
            )
        heads = config.num_attention_heads
        sizes = (config.vocab_size, 0, config.hidden_size, heads, config.intermediate_size)
        return (*sizes, config.num_hidden_layers, experts), _TRACES[key], top_k
    if isinstance(model, torch.nn.Module):  # any other language model, traced whole
        traced = trace_module(model, **_sizes(layout), dtype=layout.dtype)
        return (vocab_of(model), 0, 1, 1, 0, 0, 0), traced, 2
    taken = "a torch_mp.models.GPTConfig or DenseGPT, a Hugging Face config or model of "
    raise TypeError(
        f"plan.estimate: model must be {taken}model_type {', '.join(DECODERS)}, or an "
        f"nn.Module language model (torch_mp.plan.module); got "
        f"{type(model).__name__}" + (f" (model_type {kind!r}: not estimated yet)" if kind else "")
    )


def _sizes(layout: Layout) -> dict:
    return {"micro_batch": layout.micro_batch, "seq_len": layout.seq_len}


def estimate(
    model, layout: Layout | None = None, *, machine: Machine | str | None = None, **keywords
) -> Estimate:
    """What ``model`` trained at this layout costs each rank, as a steady step allocates it.

    Args:
        model: A :class:`torch_mp.models.GPTConfig` (or a :class:`~torch_mp.models.DenseGPT`,
            on the meta device if it would not fit), trained as
            :class:`torch_mp.models.Trainer3D` trains it; or a Hugging Face Llama, Mistral or
            Qwen2 config (or a model of one, on any device), split as ``torch_mp.parallelize``
            with ``LLAMA_PLAN`` splits it, or a Mixtral config split as with ``MIXTRAL_PLAN``,
            measured on fake tensors (:mod:`torch_mp.plan.trace`); or any other ``nn.Module``
            language model (on the meta device or any other) that takes token ids and returns
            logits, traced whole on fake tensors and split over data ranks only
            (``torch_mp.DataParallel``; ``tp``, ``pp``, ``cp`` 1 and ``recompute`` None;
            :mod:`torch_mp.plan.module`).
        layout: A :class:`Layout`; or its keywords (``tp``, ``pp``, ``dp``, ``cp``, ``ep``,
            ``zero``, ``recompute``, ``dtype``, ``master_dtype``, ``micro_batch``, ``seq_len``,
            ``num_microbatches``, ``schedule``, ``optimizer``, ``sequence_parallel``,
            ``bucket_cap_mb``, ``expert_load``; :class:`Layout` says what each means), the same
            estimate.
        machine: A :class:`Machine` (or the name or path of a machine file,
            :meth:`Machine.load`): the estimate's ``time`` is then its step on that machine.

    Returns:
        An :class:`Estimate`: one :data:`RankEstimate` per kind of rank (pipeline position),
        bytes of one rank of that kind (every tensor and data rank alike: the vocabulary and
        ZeRO's buckets are padded to the same size on each), with FLOPs and bytes sent.

    Raises:
        LayoutError: (a ValueError) Naming the setting, for sizes the layout cannot take or a
            setting not estimated yet; the same text the runtime raises for the same sizes.
        TypeError: For a model that is not estimated, or a Layout and keywords both.
    """
    layout = as_layout(layout, keywords, "plan.estimate")
    sizes, traced, top_k = _shape(model, layout)
    result = _C.plan_estimate(*sizes, layout, traced, top_k)
    if machine is not None:
        if not isinstance(machine, Machine):
            machine = Machine.load(machine)
        figures = machine.figures(layout.dtype, mesh_sizes(layout))
        result.time = _C.plan_step_time(result, layout, figures)
    return result
