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
from torch_mp.plan.machine import Machine, parse_bytes
from torch_mp.plan.measure import measure, measure_time
from torch_mp.plan.module import trace_module, vocab_of
from torch_mp.plan.search import Candidate, NothingFits, search
from torch_mp.plan.trace import DECODERS, MOE_DECODERS, trace

__all__ = [
    "Candidate",
    "Estimate",
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


def _shape(model, layout: dict, dtype: torch.dtype):
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
        tp, ep = layout["tp"], layout["ep"]
        load = _C.plan_expert_load(top_k, layout) if experts else 1.0
        key = (config.to_json_string(), tp, ep, load, layout["micro_batch"], layout["seq_len"])
        key += (dtype,)
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
        traced = trace_module(model, **_sizes(layout), dtype=dtype)
        return (vocab_of(model), 0, 1, 1, 0, 0, 0), traced, 2
    taken = "a torch_mp.models.GPTConfig or DenseGPT, a Hugging Face config or model of "
    raise TypeError(
        f"plan.estimate: model must be {taken}model_type {', '.join(DECODERS)}, or an "
        f"nn.Module language model (torch_mp.plan.module); got "
        f"{type(model).__name__}" + (f" (model_type {kind!r}: not estimated yet)" if kind else "")
    )


def _sizes(layout: dict) -> dict:
    return {"micro_batch": layout["micro_batch"], "seq_len": layout["seq_len"]}


def _bytes(dtype: torch.dtype | None, what: str) -> int:
    if dtype is None:
        return 0
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"plan.estimate: {what} must be a floating-point torch.dtype, got {dtype}")
    return dtype.itemsize


def estimate(
    model,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    ep: int = 1,
    zero: int = 0,
    recompute: str | None = None,
    dtype: torch.dtype = torch.float32,
    master_dtype: torch.dtype | None = None,
    micro_batch: int,
    seq_len: int,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
    optimizer: str = "adamw",
    sequence_parallel: bool = False,
    bucket_cap_mb: float = 25.0,
    expert_load: float | None = None,
    machine: Machine | str | None = None,
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
        tp, pp, dp, cp, ep: The mesh's sizes (cp: the GPT's, each sequence cut in 2 cp
            balanced chunks; ep: the experts of MoE layers, ``GPTConfig.moe_experts`` or
            Mixtral's, over groups cut from the dp x cp ranks, at ZeRO 0).
        zero: 0 none; 1 the optimizer state sharded over the data ranks; 2 the gradients too;
            3 the parameters too (at pp 1).
        recompute: None, ``"selective"`` (the attention core) or ``"full"`` (each layer).
        dtype: The parameters' and the compute's dtype.
        master_dtype: The optimizer's fp32 masters (and fp32 main gradients) of a 16-bit model.
            None: fp32 masters for a 16-bit ``dtype`` (the recipe, which implies ``zero >= 2``
            as Trainer3D's ``bf16`` does), none for fp32; ``master_dtype=dtype``: none.
        micro_batch, seq_len, num_microbatches: Each data rank's micro-batches per step.
        schedule: The pipeline schedule (``torch_mp.pipeline.schedule_names()``); its most
            micro-batches in flight come from walking its action list.
        optimizer: ``"adamw"`` or ``"adam"`` (two moments per parameter), ``"sgd"`` (none).
        sequence_parallel: Activations between the matmuls split over the tensor group.
        bucket_cap_mb: DataParallel's and the distributed optimizer's bucket size.
        expert_load: MoE layers at ``ep > 1``: the rows the busiest rank's experts receive over
            their balanced share (``micro_batch * seq_len * moe_top_k``), e.g. the imbalance a
            run logs. None: what routing at random gives the busiest of ``ep`` ranks,
            ``1 + sqrt(2 ln ep) * sqrt((ep - 1) / (ep * micro_batch * seq_len * top_k))``.
        machine: A :class:`Machine` (or the name or path of a machine file,
            :meth:`Machine.load`): the estimate's ``time`` is then its step on that machine.

    Returns:
        An :class:`Estimate`: one :data:`RankEstimate` per kind of rank (pipeline position),
        bytes of one rank of that kind (every tensor and data rank alike: the vocabulary and
        ZeRO's buckets are padded to the same size on each), with FLOPs and bytes sent.

    Raises:
        ValueError: Naming the setting, for sizes the layout cannot take or a setting not
            estimated yet.
    """
    if master_dtype is None and dtype.itemsize < 4:
        master_dtype = torch.float32
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "ep": ep,
        "zero": zero,
        "recompute": "none" if recompute is None else recompute,
        "sequence_parallel": sequence_parallel,
        "dtype_bytes": _bytes(dtype, "dtype"),
        "master_bytes": _bytes(master_dtype, "master_dtype"),
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "num_microbatches": num_microbatches,
        "schedule": schedule,
        "optimizer": optimizer,
        "bucket_cap_mb": float(bucket_cap_mb),
        "expert_load": 0.0 if expert_load is None else float(expert_load),
    }
    try:
        sizes, traced, top_k = _shape(model, layout, dtype)
        result = _C.plan_estimate(*sizes, layout, traced, top_k)
        if machine is not None:
            if not isinstance(machine, Machine):
                machine = Machine.load(machine)
            mesh = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
            result.time = _C.plan_step_time(result, layout, machine.figures(dtype, mesh))
        return result
    except RuntimeError as error:
        raise ValueError(str(error).split("\nException raised from")[0]) from None
