"""A Hugging Face decoder measured for the estimate: one tensor rank's share of it (heads, key and
value heads and the MLP divided by ``tp``, as ``torch_mp.parallelize`` with ``LLAMA_PLAN`` splits
them) built on fake tensors, so that nothing is allocated, and run forward and backward at the
layout's micro-batch, sequence length and dtype while the dispatcher counts the bytes
(:class:`torch_mp._memory.PeakMemory`) and the FLOPs (``torch.utils.flop_counter``). The result
is the C++ core's ``plan::Traced``: the parameters' shapes and the bytes where the GPT's formulas
do not apply."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from torch_mp._memory import PeakMemory

__all__ = ["DECODERS", "trace"]

#: The Hugging Face ``model_type``s traced: decoders of Llama's form (RMSNorm, rotary positions,
#: grouped key and value heads, a gated MLP).
DECODERS = ("llama", "mistral", "qwen2")


def _rank_config(config, tp: int, layers: int):
    """``config`` as one of ``tp`` tensor ranks holds it, with ``layers`` layers."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp:
            raise ValueError(
                f"plan.estimate: the config's {name} ({value}) is not divisible by tp={tp}"
            )
    rank = copy.deepcopy(config)
    rank.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rank.num_attention_heads = heads // tp
    rank.num_key_value_heads = kv_heads // tp
    rank.intermediate_size = config.intermediate_size // tp
    rank.num_hidden_layers = layers
    rank.use_cache = False
    return rank


@contextlib.contextmanager
def _as_on_real_tensors():
    """transformers' mask as the ranks' real run builds it. On real tensors it reads the
    positions, finds one sequence per row, and passes ``is_causal`` to SDPA with the key and
    value heads as they are; a fake tensor cannot be read, so it would build the causal mask and
    repeat the key and value heads to every query head (bytes the real run never holds). The
    trace's rows are one sequence each (positions 0 to seq_len - 1): said so here."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is not None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        if original is not None:
            masking_utils.find_packed_sequence_indices = original


def _bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _model_run(config, tp: int, layers: int, ids: torch.Tensor, dtype: torch.dtype):
    """(saved after the forward, the most the backward holds beyond, the forward's FLOPs and
    operators) of the whole model with ``layers`` layers, and the model."""
    import transformers

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # (fake parameters cannot be cast after)
    try:
        model = transformers.AutoModelForCausalLM.from_config(_rank_config(config, tp, layers))
    finally:
        torch.set_default_dtype(default)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the backward adds into them: none made at the peak
    flops = FlopCounterMode(display=False)
    with PeakMemory() as memory:
        with flops:
            loss = model(input_ids=ids, labels=ids).loss
        saved = memory.current - _bytes(loss)
        operators = memory.operators
        memory.peak = memory.current
        loss.backward()
        backward = memory.peak - saved
    return saved, backward, flops.get_total_flops(), operators, model


def trace(config, *, tp: int, micro_batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """The fields of ``plan::Traced`` for one tensor rank of ``config`` (a Hugging Face config
    whose ``model_type`` is one of :data:`DECODERS`)."""
    with FakeTensorMode(), _as_on_real_tensors():
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        saved1, backward1, flops1, ops1, model = _model_run(config, tp, 1, ids, dtype)
        saved2, _, flops2, ops2, _ = _model_run(config, tp, 2, ids, dtype)
        layer = model.model.layers[0]
        x = torch.zeros(micro_batch, seq_len, config.hidden_size, dtype=dtype, requires_grad=True)
        positions = torch.arange(seq_len).unsqueeze(0)
        rotary = model.model.rotary_emb(x, positions)
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)
        with PeakMemory() as memory:
            y = layer(x, position_embeddings=rotary, attention_mask=None, position_ids=positions)
            y = y[0] if isinstance(y, tuple) else y
            before = memory.current
            memory.peak = before
            y.backward(torch.zeros_like(y))
            layer_backward = memory.peak - before
    vocab_rows = -(-config.vocab_size // tp)  # the vocabulary's shard, padded to tp rows
    hidden = config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    last = [list(p.shape) for p in model.model.norm.parameters()]
    if not tied:
        last.append([vocab_rows, hidden])
    layer_activations = saved2 - saved1
    return {
        "layer_parameters": [list(p.shape) for p in layer.parameters()],
        "first_parameters": [[vocab_rows, hidden]],
        "last_parameters": last,
        "tied_head": tied,
        "layer_activations": layer_activations,
        "layer_input": micro_batch * seq_len * hidden * dtype.itemsize,
        "layer_backward": layer_backward,
        "first_activations": 0,
        "last_activations": saved1 - layer_activations,
        "last_backward": backward1,
        "layer_flops": float(flops2 - flops1),
        "last_flops": float(2 * flops1 - flops2),
        "layer_operators": ops2 - ops1,
        "last_operators": 2 * ops1 - ops2,
    }
