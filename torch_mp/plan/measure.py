"""What a layout really allocates: the GPT trained for a few steps on the current ranks, its
tensor memory counted at the dispatcher (:class:`torch_mp._memory.PeakMemory`). The estimate's
tests and docs/plan.md hold :func:`torch_mp.plan.estimate` to these numbers."""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time

import torch
import torch.distributed as dist

import torch_mp
from torch_mp import _C
from torch_mp._memory import PeakMemory
from torch_mp.plan.layout import Layout, as_layout, mesh_sizes
from torch_mp.plan.trace import DECODERS, MOE_DECODERS

__all__ = ["measure", "measure_time"]


def measure(
    model,
    layout: Layout | None = None,
    *,
    steps: int = 3,
    mesh: torch_mp.Mesh | None = None,
    **keywords,
) -> dict[str, int]:
    """Trains ``model`` (a :class:`torch_mp.models.GPTConfig`, a Hugging Face decoder's config,
    or an ``nn.Module`` language model that can run, :mod:`torch_mp.plan.module`, on a copy)
    laid out as given for ``steps`` optimizer steps (the third on a steady state: the buffers
    that alternate between steps are all made by then) on this rank's share of random batches,
    and returns what this rank
    allocated from building the stages on: ``{"peak": bytes, "states": bytes,
    "pipeline_rank": int}``, the most alive at once and what is left after the last step
    (parameters, gradients, optimizer state and the buffers kept from step to step).
    ``layout`` is a :class:`~torch_mp.plan.Layout` or its keywords, as
    :func:`torch_mp.plan.estimate` takes it; ``mesh`` (the default mesh when None) must have its
    sizes. A collective: every rank calls it with the same arguments."""
    from torch_mp.models import GPTConfig

    layout = as_layout(layout, keywords, "plan.measure")
    tp, pp, cp, recompute = layout.tp, layout.pp, layout.cp, layout.recompute
    mesh = mesh if mesh is not None else torch_mp.get_mesh()
    _check_mesh(mesh, mesh_sizes(layout), "plan.measure")
    if isinstance(getattr(model, "config", None), GPTConfig):
        model = model.config  # (a DenseGPT: trained as its config says)
    if not isinstance(model, GPTConfig):
        config = getattr(model, "config", model)
        decoder = getattr(config, "model_type", None) in DECODERS
        module = not decoder and isinstance(model, torch.nn.Module)
        if not (decoder or module) or pp > 1 or cp > 1:
            raise TypeError(
                "plan.measure: model must be a GPTConfig, a Hugging Face config of model_type "
                f"{', '.join(DECODERS)} or an nn.Module language model (torch_mp.plan.module), "
                f"at pp 1 and cp 1; got {type(model).__name__}"
            )
        if module and tp > 1:
            raise ValueError(
                f"plan.measure: a module traced whole is split over data ranks only, got tp={tp}"
            )
        if recompute not in (None, "full") or (recompute and not decoder):
            raise ValueError(
                f"plan.measure: a decoder takes recompute None or 'full', a module None; got "
                f"{recompute!r}"
            )
        zero, dtype = layout.zero, layout.dtype
        sizes = (layout.micro_batch, layout.seq_len, steps)
        if decoder:
            return _measure_decoder(config, mesh, zero, recompute == "full", dtype, *sizes)
        return _measure_module(model, mesh, zero, dtype, *sizes)
    build, tokens = _gpt_run(model, layout, steps)
    with _collecting_only_new(), PeakMemory() as memory:
        trainer = build(mesh)
        for batch_tokens in tokens:
            trainer.step(batch_tokens[:, :-1], batch_tokens[:, 1:])
        gc.collect()
        states = memory.current
        del trainer
        gc.collect()
    return {"peak": memory.peak, "states": states, "pipeline_rank": mesh.pp_rank}


def measure_time(
    model,
    layout: Layout | None = None,
    *,
    steps: int = 3,
    warmup: int = 2,
    mesh: torch_mp.Mesh | None = None,
    **keywords,
) -> float:
    """Seconds of one optimizer step of ``model`` (a :class:`torch_mp.models.GPTConfig`) laid
    out on ``mesh`` (the default mesh when None, of the sizes given), trained as
    :class:`torch_mp.models.Trainer3D` trains it: the median of ``steps`` steps after
    ``warmup``, each from a barrier to a barrier (so the slowest rank's). What an estimate's
    ``time`` is measured against. ``layout`` as :func:`measure` takes it. A collective."""
    layout = as_layout(layout, keywords, "plan.measure_time")
    mesh = mesh if mesh is not None else torch_mp.get_mesh()
    _check_mesh(mesh, mesh_sizes(layout), "plan.measure_time")
    build, tokens = _gpt_run(model, layout, warmup + steps)
    seconds = []
    trainer = build(mesh)
    for i, batch_tokens in enumerate(tokens):
        _C.barrier(dist.group.WORLD.group_name)
        start = time.perf_counter()
        trainer.step(batch_tokens[:, :-1], batch_tokens[:, 1:])
        _C.barrier(dist.group.WORLD.group_name)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


@contextlib.contextmanager
def _collecting_only_new():
    """``gc.collect()`` inside scans only the objects made inside: those from before (in a
    long-lived process, such as a test worker's, a heap that made each collection take 0.2 to
    0.5 s) are frozen out of it until the end. The garbage among them is collected after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_mesh(mesh, sizes: dict, who: str) -> None:
    have = {d: getattr(mesh, f"{d}_size") for d in sizes}
    if have != sizes:
        raise ValueError(f"{who}: the mesh is {have}, the layout asks for {sizes}")


def _gpt_run(config, layout: Layout, steps: int):
    """A function of the mesh that builds the GPT's Trainer3D at ``layout`` (same weights on
    every rank), and ``steps`` random batches of tokens (inputs and targets)."""
    from torch_mp.models import DenseGPT, Trainer3D, TrainingOptions

    if layout.optimizer != "adamw":
        raise ValueError(
            f"plan.measure: trains with AdamW only, got optimizer={layout.optimizer!r}"
        )
    dtype, master_dtype = layout.dtype, layout.master_dtype
    if dtype not in (torch.float32, torch.bfloat16) or master_dtype not in (None, torch.float32):
        raise ValueError(
            "plan.measure: dtype float32, or bfloat16 with fp32 masters (master_dtype None or "
            f"float32), got dtype={dtype}, master_dtype={master_dtype}"
        )
    options = TrainingOptions(
        schedule=layout.schedule,
        microbatches=layout.num_microbatches,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute,
        zero=layout.zero,
        bf16=dtype == torch.bfloat16,
    )
    torch.manual_seed(0)
    dense = DenseGPT(config)
    g = torch.Generator().manual_seed(1)
    batch = layout.micro_batch * layout.num_microbatches
    shape = (batch, layout.seq_len + 1)
    tokens = [torch.randint(config.vocab, shape, generator=g) for _ in range(steps)]
    return (lambda mesh: Trainer3D(dense, mesh, options)), tokens


def _measure_decoder(config, mesh, zero, recompute, dtype, micro_batch, seq_len, steps):
    """A Hugging Face decoder trained as examples/python/llama.py trains it: split by
    ``torch_mp.parallelize`` with ``LLAMA_PLAN`` (Mixtral's with ``MIXTRAL_PLAN``), under
    DataParallel (:func:`_train_data_parallel`), every layer recomputed with ``recompute``."""
    import functools

    import transformers

    from torch_mp.parallelize import LLAMA_PLAN, MIXTRAL_PLAN

    config = copy.deepcopy(config)
    config.use_cache = False

    def build():
        dense = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        moe = config.model_type in MOE_DECODERS
        model = torch_mp.parallelize(dense, mesh, plan=MIXTRAL_PLAN if moe else LLAMA_PLAN)
        if recompute:
            for layer in model.model.layers:
                layer.forward = functools.partial(torch_mp.recompute, layer.forward)
        return model

    def step(model, ids):
        return model(input_ids=ids, labels=ids).loss

    def unit(module):  # (ZeRO-3: each decoder layer gathered as one)
        return type(module).__name__.endswith("DecoderLayer")

    sizes = (config.vocab_size, micro_batch, seq_len, steps)
    return _train_data_parallel(build, step, mesh, zero, dtype, *sizes, unit=unit)


def _measure_module(module, mesh, zero, dtype, micro_batch, seq_len, steps):
    """A language model traced whole (:mod:`torch_mp.plan.module`): a copy of ``module`` in
    ``dtype`` under DataParallel (:func:`_train_data_parallel`), trained on that module's
    loss."""
    from torch_mp.plan.module import loss, vocab_of

    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            "plan.measure: the module is on the meta device; measure one that can run (the "
            "estimate takes it on the meta device)"
        )

    def build():
        return copy.deepcopy(module).to(dtype)

    def step(model, ids):
        return loss(model(ids), ids)

    vocab = vocab_of(module)
    return _train_data_parallel(build, step, mesh, zero, dtype, vocab, micro_batch, seq_len, steps)


def _train_data_parallel(
    build, step, mesh, zero, dtype, vocab, micro_batch, seq_len, steps, unit=None
):
    """What a rank allocates to train ``build()`` for ``steps`` steps of ``step(model, ids)``
    (the loss) on random token ids below ``vocab``: under DataParallel (its gradients sharded
    at ZeRO-2, fp32 main gradients in bf16, its parameters at ZeRO-3 in units of ``unit``),
    AdamW (the DistributedOptimizer at ZeRO >= 1, fp32 masters in bf16)."""
    bf16 = dtype == torch.bfloat16
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(vocab, (micro_batch, seq_len), generator=g) for _ in range(steps)]
    with _collecting_only_new(), PeakMemory() as memory:
        model = build()
        wrapped = torch_mp.DataParallel(
            model,
            mesh=mesh,
            shard_gradients=zero >= 2 or bf16,
            shard_parameters=zero == 3,
            unit=unit if zero == 3 else None,
            grad_dtype=torch.float32 if bf16 else None,
        )
        if zero >= 1 or bf16:
            optimizer = torch_mp.DistributedOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                mesh=mesh,
                master_dtype=torch.float32 if bf16 else None,
            )
        else:
            optimizer = torch.optim.AdamW(model.parameters())
        gc.collect()
        for ids in tokens:
            optimizer.zero_grad()
            step(wrapped, ids).backward()
            optimizer.step()
        gc.collect()
        states = memory.current
        del wrapped, model, optimizer
        gc.collect()
    return {"peak": memory.peak, "states": states, "pipeline_rank": mesh.pp_rank}
