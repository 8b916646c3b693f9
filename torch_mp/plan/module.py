"""Any language model measured for the estimate, traced whole: an ``nn.Module`` (on the meta
device or any other) that is neither torch_mp's GPT nor a Hugging Face decoder of
:data:`torch_mp.plan.DECODERS`, split over data ranks only (``torch_mp.DataParallel``, ZeRO-1 to
3 with ``torch_mp.DistributedOptimizer``). Its parameters' shapes and buffers are read from the
module; its forward and backward run on fake tensors (nothing is allocated) at the layout's
micro-batch, sequence length and dtype while the dispatcher counts the bytes and FLOPs, as
:mod:`torch_mp.plan.trace` does for a decoder's layers.

The module's forward takes a batch of token ids ``[micro_batch, seq_len]`` (int64) and returns
the logits ``[micro_batch, seq_len, vocab]`` (a tensor, an output with ``.logits`` as Hugging
Face models return, or a tuple that starts with them); the loss is :func:`loss`, the
cross-entropy of the logits (in fp32) against the ids. :func:`torch_mp.plan.measure` trains it
the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from torch_mp._memory import PeakMemory

__all__ = ["loss", "trace_module", "vocab_of"]


def loss(output, ids: torch.Tensor) -> torch.Tensor:
    """The loss a module traced whole is trained with: the cross-entropy, in fp32, of its logits
    (``output``, its ``.logits`` or its first element) against the token ids ``ids``."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != ids.shape:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            "plan.estimate: a module is traced on token ids [micro_batch, seq_len] and must "
            f"return logits [micro_batch, seq_len, vocab]; for ids {tuple(ids.shape)} it "
            f"returned {shape}"
        )
    return F.cross_entropy(logits.flatten(0, -2).float(), ids.flatten())


def vocab_of(model: nn.Module) -> int:
    """The rows of ``model``'s first ``nn.Embedding``: the token ids it takes."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise TypeError(
        f"plan.estimate: a module is traced on token ids, and {type(model).__name__} has no "
        "nn.Embedding to take them"
    )


def _units(model: nn.Module) -> list[int]:
    """ZeRO-3's unit of each parameter, as ``DataParallel(shard_parameters=True)`` gathers them
    by default (each child a unit)."""
    from torch_mp.data_parallel import _units as data_parallel_units

    return [index for _, index in data_parallel_units(model, None)]


def _fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor of ``t``'s shape, floating ones in ``dtype`` (as ``model.to(dtype)`` casts
    them)."""
    kind = dtype if t.is_floating_point() else t.dtype
    return torch.zeros(t.shape, dtype=kind, requires_grad=t.requires_grad)


def trace_module(model: nn.Module, *, micro_batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """The fields of ``plan::Traced`` for ``model`` traced whole (no layers told apart: every
    parameter among the first, with its ZeRO-3 unit; everything saved, the backward's most and
    the FLOPs counted as the last stage's)."""
    vocab_of(model)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:  # (fake tensors index past it)
        raise ValueError(
            f"plan.estimate: seq_len={seq_len} exceeds the model's {positions} positions "
            "(its config's max_position_embeddings)"
        )
    named = dict(model.named_parameters())
    for name, p in named.items():
        if not p.requires_grad:
            raise ValueError(
                "plan.estimate: a module traced whole is estimated with every parameter trained; "
                f"{name} does not require grad"
            )
    with FakeTensorMode(), _as_on_real_tensors(model):
        tensors = {name: _fake(p, dtype) for name, p in named.items()}
        for name, b in model.named_buffers():
            tensors[name] = _fake(b, dtype)
        for name in named:  # (the backward adds into them: none made at the peak)
            tensors[name].grad = torch.zeros_like(tensors[name])
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        flops = FlopCounterMode(display=False)
        with PeakMemory() as memory:
            with flops:
                value = loss(functional_call(model, tensors, (ids,)), ids)
            operators = memory.operators  # (the forward's: the time estimate scales them)
            saved = memory.current - value.untyped_storage().nbytes()
            memory.peak = memory.current
            value.backward()
            backward = memory.peak - saved
    return {
        "first_parameters": [list(p.shape) for p in named.values()],
        "first_units": _units(model),
        "last_activations": saved,
        "last_backward": backward,
        "last_flops": float(flops.get_total_flops()),
        "last_operators": operators,
    }


def _as_on_real_tensors(model: nn.Module):
    """A Hugging Face model's masks as its real run builds them (see
    :func:`torch_mp.plan.trace._as_on_real_tensors`); nothing for other modules."""
    import contextlib

    if not type(model).__module__.startswith("transformers."):
        return contextlib.nullcontext()
    from torch_mp.plan.trace import _as_on_real_tensors as on_real

    return on_real()
