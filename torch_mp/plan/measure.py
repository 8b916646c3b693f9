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
from torch_mp._memory import PeakMemory
from torch_mp.plan.trace import DECODERS

__all__ = ["measure", "measure_time"]


def measure(
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
    steps: int = 3,
    mesh: torch_mp.Mesh | None = None,
) -> dict[str, int]:
    """Trains ``model`` (a :class:`torch_mp.models.GPTConfig`) laid out as given for ``steps``
    optimizer steps (the third on a steady state: the buffers that alternate between steps are
    all made by then) on this rank's share of random batches, and returns what this rank
    allocated from building the stages on: ``{"peak": bytes, "states": bytes,
    "pipeline_rank": int}``, the most alive at once and what is left after the last step
    (parameters, gradients, optimizer state and the buffers kept from step to step). The
    keywords are :func:`torch_mp.plan.estimate`'s; ``mesh`` (the default mesh when None) must
    have the sizes given. A collective: every rank
    calls it with the same arguments."""
    from torch_mp.models import GPTConfig

    mesh = mesh if mesh is not None else torch_mp.get_mesh()
    _check_mesh(mesh, {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}, "plan.measure")
    if not isinstance(model, GPTConfig):
        if getattr(model, "model_type", None) not in DECODERS or pp > 1 or zero > 2 or cp > 1:
            raise TypeError(
                "plan.measure: model must be a GPTConfig, or a Hugging Face config of model_type "
                f"{', '.join(DECODERS)} at pp 1, cp 1 and zero <= 2; got {type(model).__name__}"
            )
        return _measure_decoder(model, mesh, zero, recompute, dtype, micro_batch, seq_len, steps)
    layout = dict(
        zero=zero,
        recompute=recompute,
        dtype=dtype,
        master_dtype=master_dtype,
        micro_batch=micro_batch,
        seq_len=seq_len,
        num_microbatches=num_microbatches,
        schedule=schedule,
        optimizer=optimizer,
        sequence_parallel=sequence_parallel,
    )
    build, tokens = _gpt_run(model, layout, steps)
    gc.collect()
    with _default_mesh(mesh), PeakMemory() as memory:
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
    steps: int = 3,
    warmup: int = 2,
    mesh: torch_mp.Mesh | None = None,
) -> float:
    """Seconds of one optimizer step of ``model`` (a :class:`torch_mp.models.GPTConfig`) laid
    out on ``mesh`` (the default mesh when None, of the sizes given), trained as
    :class:`torch_mp.models.Trainer3D` trains it: the median of ``steps`` steps after
    ``warmup``, each from a barrier to a barrier (so the slowest rank's). What an estimate's
    ``time`` is measured against. A collective."""
    mesh = mesh if mesh is not None else torch_mp.get_mesh()
    _check_mesh(mesh, {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}, "plan.measure_time")
    layout = dict(
        zero=zero,
        recompute=recompute,
        dtype=dtype,
        master_dtype=master_dtype,
        micro_batch=micro_batch,
        seq_len=seq_len,
        num_microbatches=num_microbatches,
        schedule=schedule,
        optimizer=optimizer,
        sequence_parallel=sequence_parallel,
    )
    build, tokens = _gpt_run(model, layout, warmup + steps)
    seconds = []
    with _default_mesh(mesh):
        trainer = build(mesh)
        for i, batch_tokens in enumerate(tokens):
            dist.barrier()
            start = time.perf_counter()
            trainer.step(batch_tokens[:, :-1], batch_tokens[:, 1:])
            dist.barrier()
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _check_mesh(mesh, sizes: dict, who: str) -> None:
    have = {d: getattr(mesh, f"{d}_size") for d in sizes}
    if have != sizes:
        raise ValueError(f"{who}: the mesh is {have}, the layout asks for {sizes}")


@contextlib.contextmanager
def _default_mesh(mesh):
    """``mesh`` as the default mesh (for whatever in the stages looks for it)."""
    previous = torch_mp.mesh.find_mesh()
    torch_mp.set_mesh(mesh)
    try:
        yield
    finally:
        torch_mp.set_mesh(previous)


def _gpt_run(config, layout: dict, steps: int):
    """A function of the mesh that builds the GPT's Trainer3D at ``layout`` (same weights on
    every rank), and ``steps`` random batches of tokens (inputs and targets)."""
    from torch_mp.models import DenseGPT, Trainer3D, TrainingOptions

    if layout["optimizer"] != "adamw":
        raise ValueError(
            f"plan.measure: trains with AdamW only, got optimizer={layout['optimizer']!r}"
        )
    dtype, master_dtype = layout["dtype"], layout["master_dtype"]
    if dtype not in (torch.float32, torch.bfloat16) or master_dtype not in (None, torch.float32):
        raise ValueError(
            "plan.measure: dtype float32, or bfloat16 with fp32 masters (master_dtype None or "
            f"float32), got dtype={dtype}, master_dtype={master_dtype}"
        )
    options = TrainingOptions(
        schedule=layout["schedule"],
        microbatches=layout["num_microbatches"],
        sequence_parallel=layout["sequence_parallel"],
        recompute=layout["recompute"],
        zero=layout["zero"],
        bf16=dtype == torch.bfloat16,
    )
    torch.manual_seed(0)
    dense = DenseGPT(config)
    g = torch.Generator().manual_seed(1)
    batch = layout["micro_batch"] * layout["num_microbatches"]
    shape = (batch, layout["seq_len"] + 1)
    tokens = [torch.randint(config.vocab, shape, generator=g) for _ in range(steps)]
    return (lambda mesh: Trainer3D(dense, mesh, options)), tokens


def _measure_decoder(config, mesh, zero, recompute, dtype, micro_batch, seq_len, steps):
    """A Hugging Face decoder trained as examples/python/llama.py trains it: split by
    ``torch_mp.parallelize`` with ``LLAMA_PLAN``, under DataParallel (its gradients sharded at
    ZeRO-2, fp32 main gradients in bf16), AdamW (the DistributedOptimizer at ZeRO-1/2, fp32
    masters in bf16), every layer recomputed with ``recompute="full"``."""
    import functools

    import transformers

    from torch_mp.parallelize import LLAMA_PLAN

    if recompute not in (None, "full"):
        raise ValueError(
            f"plan.measure: a decoder takes recompute None or 'full', got {recompute!r}"
        )
    bf16 = dtype == torch.bfloat16
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens = [
        torch.randint(config.vocab_size, (micro_batch, seq_len), generator=g) for _ in range(steps)
    ]
    config = copy.deepcopy(config)
    config.use_cache = False
    gc.collect()
    with PeakMemory() as memory:
        dense = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        model = torch_mp.parallelize(dense, mesh, plan=LLAMA_PLAN)
        del dense
        if recompute == "full":
            for layer in model.model.layers:
                layer.forward = functools.partial(torch_mp.recompute, layer.forward)
        sharded = zero >= 2 or bf16
        wrapped = torch_mp.DataParallel(
            model,
            mesh=mesh,
            shard_gradients=sharded,
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
            wrapped(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        gc.collect()
        states = memory.current
        del wrapped, model, optimizer
    gc.collect()
    return {"peak": memory.peak, "states": states, "pipeline_rank": mesh.pp_rank}
