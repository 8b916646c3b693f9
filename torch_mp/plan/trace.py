"""A Hugging Face decoder measured for the estimate: one tensor rank's share of it (heads, key and
value heads and the MLP divided by ``tp``, as ``torch_mp.parallelize`` with ``LLAMA_PLAN`` splits
them; a Mixtral's experts divided by ``ep`` as ``MIXTRAL_PLAN`` splits them) built on fake
tensors, so that nothing is allocated, and run forward and backward at the layout's micro-batch,
sequence length and dtype while the dispatcher counts the bytes
(:class:`torch_mp._memory.PeakMemory`) and the FLOPs (``torch.utils.flop_counter``). The result
is the C++ core's ``plan::Traced``: the parameters' shapes and the bytes where the GPT's formulas
do not apply."""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from torch_mp._C import LayoutError
from torch_mp._memory import PeakMemory

__all__ = ["DECODERS", "trace"]

#: The Hugging Face ``model_type``s traced: decoders of Llama's form (RMSNorm, rotary positions,
#: grouped key and value heads, a gated MLP, or Mixtral's sparse mixture of gated experts).
DECODERS = ("llama", "mistral", "qwen2", "mixtral")
#: Of those, the ones whose MLPs are mixtures of experts (``torch_mp.parallelize`` with
#: ``MIXTRAL_PLAN``).
MOE_DECODERS = ("mixtral",)


class _ExpertsAtLoad(nn.Module):
    """Stands in for a Mixtral sparse MoE block in the trace: what ``torch_mp.moe.MoE`` (with
    ``MIXTRAL_PLAN``'s block, ``_SparseMoeBlock``) runs and saves, on one rank of an expert group
    of ``ep`` whose experts receive ``rows`` rows (routing cannot be read on fake tensors): the
    gate (run twice, once for the model's recorders), the softmax, the top k renormalised, each
    choice's row gathered (and at ``ep > 1`` sorted on arrival), the gated experts' two
    products, the results sent back, weighted and summed per token."""

    def __init__(self, config, ep: int, rows: int) -> None:
        super().__init__()
        h, f, e = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.top_k, self.ep, self.rows = config.num_experts_per_tok, ep, rows
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(e // ep, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e // ep, h, f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        self.gate(tokens)
        probabilities = self.gate(tokens).float().softmax(-1)
        top, _ = probabilities.topk(self.top_k, -1)
        weights = top / top.sum(-1, keepdim=True)
        choices = tokens.shape[0] * self.top_k
        choice = torch.arange(choices, device=x.device)
        token = choice // self.top_k
        weight = weights.flatten().index_select(0, choice)
        rows = tokens.index_select(0, token)
        if self.ep > 1:
            rows = rows.index_select(0, torch.zeros(self.rows, dtype=torch.long))
        gate, up = (rows @ self.gate_up_proj[0].T).chunk(2, -1)
        out = (F.silu(gate) * up) @ self.down_proj[0].T
        if self.ep > 1:
            out = out.index_select(0, torch.zeros(choices, dtype=torch.long))
        weighted = (out * weight.unsqueeze(1)).to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, token, weighted).view_as(x)


def _rank_config(config, tp: int, layers: int):
    """``config`` as one of ``tp`` tensor ranks holds it, with ``layers`` layers (a mixture of
    experts' whole: every tensor rank runs it on the same tokens)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    moe = config.model_type in MOE_DECODERS
    split = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if not moe:
        split["intermediate_size"] = config.intermediate_size
    for name, value in split.items():
        if value % tp:
            raise LayoutError(
                f"plan.estimate: the config's {name} ({value}) is not divisible by tp={tp}"
            )
    rank = copy.deepcopy(config)
    rank.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rank.num_attention_heads = heads // tp
    rank.num_key_value_heads = kv_heads // tp
    rank.intermediate_size = config.intermediate_size // (1 if moe else tp)
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


def _model_run(config, tp: int, ep: int, rows: int, layers: int, ids, dtype: torch.dtype):
    """(saved after the forward, the most the backward holds beyond, the forward's FLOPs and
    operators) of the whole model with ``layers`` layers, and the model."""
    import transformers

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # (fake parameters cannot be cast after)
    try:
        rank = _rank_config(config, tp, layers)
        model = transformers.AutoModelForCausalLM.from_config(rank)
        if config.model_type in MOE_DECODERS:
            for layer in model.model.layers:
                layer.mlp = _ExpertsAtLoad(rank, ep, rows)
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


def trace(
    config,
    *,
    tp: int,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    ep: int = 1,
    expert_load: float = 1.0,
) -> dict:
    """The fields of ``plan::Traced`` for one tensor rank of ``config`` (a Hugging Face config
    whose ``model_type`` is one of :data:`DECODERS`); a mixture of experts' on one rank of an
    expert group of ``ep`` whose experts receive ``expert_load`` times their balanced share of
    the choices."""
    if config.model_type in MOE_DECODERS and config.num_local_experts % ep:
        raise LayoutError(
            f"plan.estimate: the config's num_local_experts ({config.num_local_experts}) is not "
            f"divisible by ep={ep}"
        )
    choices = micro_batch * seq_len * getattr(config, "num_experts_per_tok", 1)
    run = functools.partial(_model_run, config, tp, ep, round(choices * expert_load))
    with FakeTensorMode(), _as_on_real_tensors():
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        saved1, backward1, flops1, ops1, model = run(1, ids, dtype)
        saved2, _, flops2, ops2, _ = run(2, ids, dtype)
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
