"""The planner: every layout of a model on ``world`` devices that the estimate accepts and that
fits in each device's memory, ranked by the estimated step time (docs/plan.md, "The planner").

``python -m torch_mp.plan`` is its command line (torch_mp/plan/__main__.py)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
import time
from dataclasses import dataclass

import torch

from torch_mp._C import LayoutError
from torch_mp.plan.layout import Layout

__all__ = ["Candidate", "NothingFits", "search"]


@dataclass
class Candidate:
    """One layout: its :class:`~torch_mp.plan.Layout`, its ``estimate`` (with ``.time``), and
    ``peak``, the largest of its ranks' peaks in bytes."""

    layout: Layout
    estimate: object
    peak: int

    def __post_init__(self) -> None:
        if isinstance(self.layout, dict):  # (the keywords, as a Candidate was once made)
            self.layout = Layout(**self.layout)

    @property
    def keywords(self) -> dict:
        """The layout as :func:`torch_mp.plan.estimate`'s keywords (``layout.keywords()``)."""
        return self.layout.keywords()

    @property
    def seconds(self) -> float:
        return self.estimate.time.seconds

    def describe(self) -> str:
        """The layout in short: ``tp2 pp4 dp8 mb1x16 1f1b zero1 selective sp``."""
        k = self.layout
        parts = [f"tp{k.tp}", f"pp{k.pp}", f"dp{k.dp}"]
        if k.cp > 1:
            parts.append(f"cp{k.cp}")
        if k.ep > 1:
            parts.append(f"ep{k.ep}")
        parts.append(f"mb{k.micro_batch}x{k.num_microbatches}")
        if k.pp > 1:
            parts.append(k.schedule)
        parts.append(f"zero{k.zero}")
        if k.recompute:
            parts.append(k.recompute)
        if k.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


class NothingFits(ValueError):
    """No layout fits: the message names the smallest memory any would take and the largest
    number of layers that would fit."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(model, world: int, global_batch: int, seq_len: int, dtype, gpus_per_node):
    """Every combination to try (the estimate refuses those the model or the trainer cannot
    take: heads, ffn or layers not divisible, ZeRO-3 with a pipeline, ...)."""
    from torch_mp.plan.trace import DECODERS, MOE_DECODERS

    config = getattr(model, "config", model)
    kind = getattr(config, "model_type", None)
    decoder = kind in DECODERS
    experts = getattr(config, "moe_experts", 0) or (
        config.num_local_experts if kind in MOE_DECODERS else 0
    )
    sixteen = dtype.itemsize < 4
    # (MoE layers take no context parallelism, recomputation or sequence parallelism)
    cps = [1] if decoder or experts else [1, 2, 4, 8]
    for tp, cp in itertools.product(_divisors(world), cps):
        if world % (tp * cp) or seq_len % (2 * cp) or (gpus_per_node and tp * cp > gpus_per_node):
            continue  # (tensor and context groups across nodes: never worth it)
        for pp in [1] if decoder else _divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            for micro_batch in [m for m in (1, 2, 4, 8) if per_rank % m == 0]:
                microbatches = per_rank // micro_batch
                schedules = ["1f1b", "interleaved_1f1b"] if pp > 1 else ["1f1b"]
                zeros = ([2] if sixteen else [0, 1, 2]) + ([3] if pp == 1 and dp > 1 else [])
                if dp == 1:
                    zeros = [2] if sixteen else [0]
                recomputes = [None, "full"] if decoder else [None, "selective", "full"]
                parallel = [False, True] if tp > 1 and not decoder else [False]
                if experts:
                    recomputes, parallel = [None], [False]
                # the experts over groups cut from the data ranks (at ZeRO 0 beyond one)
                eps = [e for e in _divisors(dp * cp) if experts % e == 0] if experts else [1]
                for schedule, zero, recompute, sp, ep in itertools.product(
                    schedules, zeros, recomputes, parallel, eps
                ):  # (the estimate refuses what the trainer and the schedule cannot take)
                    yield Layout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        cp=cp,
                        ep=ep,
                        zero=zero,
                        recompute=recompute,
                        dtype=dtype,
                        micro_batch=micro_batch,
                        seq_len=seq_len,
                        num_microbatches=microbatches,
                        schedule=schedule,
                        sequence_parallel=sp,
                    )


class _Progress:
    """A bar on stderr (a terminal), drawn once the search has taken a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.start, self.drawn = total, time.monotonic(), False
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, done: int) -> None:
        if not self.enabled or (not self.drawn and time.monotonic() - self.start < 1.0):
            return
        self.drawn = True
        filled = 30 * done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} layouts")
        sys.stderr.flush()

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")


def _evaluate(model, world, memory, seq_len, global_batch, machine, dtype, progress):
    """(the candidates that fit, sorted fastest first; the smallest peak of any valid one and
    its candidate)."""
    from torch_mp import plan

    layouts = list(
        _layouts(model, world, global_batch, seq_len, dtype, machine.gpus_per_node or None)
    )
    bar = _Progress(len(layouts), progress)
    fits, smallest = [], None
    for i, layout in enumerate(layouts):
        bar.update(i)
        try:
            e = plan.estimate(model, layout, machine=machine)
        except LayoutError:
            continue  # a layout the model or the trainer cannot take
        candidate = Candidate(layout, e, max(r.peak for r in e.ranks))
        if smallest is None or candidate.peak < smallest.peak:
            smallest = candidate
        if candidate.peak <= memory:
            fits.append(candidate)
    bar.update(len(layouts))
    bar.close()
    # fastest first; of layouts as fast, the smallest peak, then the fewest settings
    fits.sort(key=lambda c: (c.seconds, c.peak, len(c.describe())))
    return fits, smallest


def _with_layers(model, layers: int):
    config = getattr(model, "config", model)
    if dataclasses.is_dataclass(config):  # (a GPTConfig)
        return dataclasses.replace(config, layers=layers)
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    return config


def _layers_of(model) -> int:
    config = getattr(model, "config", model)
    return getattr(config, "num_hidden_layers", None) or config.layers


def search(
    model,
    *,
    world: int,
    memory: int | str | None = None,
    seq_len: int,
    global_batch: int,
    machine,
    dtype: torch.dtype = torch.bfloat16,
    top: int = 10,
    progress: bool = True,
) -> list[Candidate]:
    """The ``top`` fastest layouts of ``model`` on ``world`` devices of ``machine``.

    Args:
        model: What :func:`torch_mp.plan.estimate` takes (a GPTConfig, a Hugging Face Llama,
            Mistral, Qwen2 or Mixtral config).
        world: Devices in all.
        memory: Bytes (or ``"80GB"``) each device has for the step; None: the machine's.
        seq_len, global_batch: Tokens of a sequence, sequences of a step (all data ranks').
        machine: A :class:`torch_mp.plan.Machine` or a machine file's name or path.
        dtype: The parameters' and compute's (16-bit: the bf16 recipe, fp32 masters).
        top: How many to return.
        progress: A bar on stderr (a terminal) while the search runs for more than a second.

    Tries tp x cp (within a node, when the machine says how many devices one has) x pp x dp over
    micro-batches of 1, 2, 4 and 8 sequences, the 1f1b and interleaved schedules, ZeRO 0-3,
    recomputation none, selective and full, and sequence parallelism; a Hugging Face decoder
    at pp 1 and cp 1 with recomputation none or full (as ``torch_mp.parallelize`` runs it); with
    MoE layers, ep over the divisors of dp x cp that divide the experts, at ZeRO 0 beyond ep 1,
    without recomputation, sequence or context parallelism (what they take). What the estimate
    refuses (sizes that do not divide, what the trainer cannot run) is left out.

    Returns:
        The candidates that fit, fastest step first.

    Raises:
        NothingFits: Naming the smallest memory a layout would take and the largest number of
            layers that fits in ``memory``.
    """
    from torch_mp.plan import estimate as plan_estimate
    from torch_mp.plan.machine import Machine, parse_bytes

    if not isinstance(machine, Machine):
        machine = Machine.load(machine)
    if memory is None:
        if machine.memory is None:
            raise ValueError("plan.search: give memory, or a machine that says its memory")
        memory = machine.memory
    memory = parse_bytes(memory)
    if world < 1 or global_batch < 1 or seq_len < 1:
        raise ValueError(
            f"plan.search: world, global_batch and seq_len must be at least 1, got {world}, "
            f"{global_batch}, {seq_len}"
        )
    # what the model itself cannot take (a sequence past its positions, a model not estimated)
    plan_estimate(model, micro_batch=1, seq_len=seq_len, dtype=dtype)
    run = (world, memory, seq_len, global_batch, machine, dtype)
    fits, smallest = _evaluate(model, *run, progress)
    if fits:
        return fits[:top]
    if smallest is None:
        raise NothingFits(
            f"plan.search: no layout of {world} devices can take this model at global batch "
            f"{global_batch} (tp must divide its heads and ffn, pp its layers, dp the batch)"
        )
    # the largest number of layers that fits (fewer layers never take more memory)
    low, high = 0, _layers_of(model)
    while high - low > 1:
        middle = (low + high) // 2
        if _evaluate(_with_layers(model, middle), *run, False)[0]:
            low = middle
        else:
            high = middle
    gb = 1e9
    raise NothingFits(
        f"plan.search: nothing fits in {memory / gb:.1f} GB a device: the smallest peak is "
        f"{smallest.peak / gb:.1f} GB ({smallest.describe()}); with these settings at most "
        f"{low} of the model's {_layers_of(model)} layers fit"
    )
