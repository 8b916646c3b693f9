"""The tensor-parallel computations as torch.compile traces them.

Eager, the modules call the C++ core (``torch_mp._C``), which pybind11 exposes as functions that
Dynamo cannot look into. Under ``torch.compile`` they call these instead: the same mathematics
built from ATen operations and the core's collectives registered as PyTorch operators
(``torch.ops.torch_mp.all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``split``, see
``csrc/torch_mp/ops.cpp``: groups passed by name, meta kernels for shapes), made differentiable
here with ``torch.autograd.Function``. ``torch.compile(model, fullgraph=True)`` then captures a
tensor-parallel MLP, transformer layer (tensor or sequence parallel) and the vocabulary-parallel
loss in one graph, equal to eager (``tests/python/test_compile.py``).

Not traced yet: dropout inside the tensor-parallel region with p > 0 in training (it draws from
the core's per-rank generator; refused with an error under compile), and the eager path's checks
of ids and targets against the vocabulary (an out-of-range id or target is an error eager, not
compiled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "activation",
    "attention_heads",
    "column_parallel_conv2d",
    "column_parallel_linear",
    "conv2d_as",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "layer_norm",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "region_dropout",
    "row_parallel_conv2d",
    "row_parallel_linear",
    "scatter_to_tp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


def _ops():
    return torch.ops.torch_mp


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _ops().all_reduce(grad, "sum", ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str):
        return _ops().all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, dim: int):
        ctx.group, ctx.dim = group, dim
        return _ops().split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _ops().all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, dim: int):
        ctx.group, ctx.dim = group, dim
        return _ops().all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _ops().split(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, dim: int):
        ctx.group, ctx.dim = group, dim
        return _ops().all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _ops().reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, dim: int):
        ctx.group, ctx.dim = group, dim
        return _ops().reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _ops().all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward; gradient all-reduced over the group."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """All-reduce forward; gradient passed through."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: str, dim: int = -1) -> torch.Tensor:
    """This rank's chunk along ``dim``; gradient all-gathered."""
    return _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group: str, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim``; gradient split."""
    return _GatherFromTP.apply(x, group, dim)


def gather_from_sp(x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
    """All-gather along the sequence dim; gradient reduce-scattered."""
    return _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along the sequence dim; gradient all-gathered."""
    return _ReduceScatterToSP.apply(x, group, dim)


def column_parallel_linear(x, weight, bias, gather_output: bool, sequence_parallel: bool, group):
    x = gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)
    y = F.linear(x, weight, bias)
    return gather_from_tp(y, group, -1) if gather_output else y


def row_parallel_linear(x, weight, bias, input_is_parallel: bool, sequence_parallel: bool, group):
    if not input_is_parallel:
        x = scatter_to_tp(x, group, -1)
    y = F.linear(x, weight)
    if sequence_parallel:  # each rank adds the (replicated) bias to its rows: sum its gradient
        y = reduce_scatter_to_sp(y, group)
        bias = None if bias is None else copy_to_tp(bias, group)
    else:
        y = reduce_from_tp(y, group)
    return y if bias is None else y + bias


def conv2d_as(x, weight, bias, stride, padding, dilation, padding_mode: str):
    """``F.conv2d`` with an ``nn.Conv2d``'s geometry, as the core's conv2d_as applies it: a
    non-zero padding mode pads first ("same": each dim's total, its smaller half before)."""
    if padding_mode != "zeros":
        pads = []
        for i in (1, 0):  # last dim first, as F.pad takes them
            if padding == "same":
                total = dilation[i] * (weight.shape[2 + i] - 1)
                pads += [total // 2, total - total // 2]
            elif padding == "valid":
                pads += [0, 0]
            else:
                pads += [padding[i], padding[i]]
        return F.conv2d(F.pad(x, pads, mode=padding_mode), weight, bias, stride, 0, dilation)
    return F.conv2d(x, weight, bias, stride, padding, dilation)


def column_parallel_conv2d(x, weight, bias, geometry: tuple, gather_output: bool, group: str):
    y = conv2d_as(copy_to_tp(x, group), weight, bias, *geometry)
    return gather_from_tp(y, group, 1) if gather_output else y


def row_parallel_conv2d(x, weight, bias, geometry: tuple, input_is_parallel: bool, group: str):
    if not input_is_parallel:
        x = scatter_to_tp(x, group, 1)
    y = reduce_from_tp(conv2d_as(x, weight, None, *geometry), group)
    return y if bias is None else y + bias.view(-1, 1, 1)


def layer_norm(x, weight, bias, eps: float, sequence_parallel: bool, group: str):
    """A LayerNorm whose replicated parameters, under sequence parallelism, have their
    gradients summed over the group (each rank saw only its rows)."""
    if sequence_parallel:
        weight = None if weight is None else copy_to_tp(weight, group)
        bias = None if bias is None else copy_to_tp(bias, group)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"torch_mp: activation must be 'relu' or 'gelu', got {name!r}")


def region_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if training and p > 0:
        raise NotImplementedError(
            "torch_mp: dropout inside a tensor-parallel region (p > 0, training) draws from the "
            "core's per-rank generator, which torch.compile does not trace yet; compile with "
            "dropout 0 or call model.eval()"
        )
    return x


def attention_heads(
    qkv: torch.Tensor,
    num_heads: int,
    group: str,
    tp_size: int,
    tp_rank: int,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
) -> torch.Tensor:
    """This rank's heads of attention over ``qkv`` ``[s, b, 3 * h_local]``, as the core's
    attention_heads computes them."""
    if dropout_p > 0:
        region_dropout(qkv, dropout_p, True)
    heads = num_heads // tp_size
    s, b, width3 = qkv.shape
    width = width3 // 3
    head_dim = width // heads

    def split_heads(t):
        return t.reshape(s, b, heads, head_dim).permute(1, 2, 0, 3)

    q, k, v = qkv.chunk(3, -1)
    mask = attn_mask
    if mask is not None:
        if mask.dim() == 3:  # [b * num_heads, s, s]: this rank's heads
            mask = mask.reshape(b, num_heads, s, s).narrow(1, tp_rank * heads, heads)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=qkv.dtype, device=qkv.device).masked_fill(
                mask, float("-inf")
            )
    context = F.scaled_dot_product_attention(
        split_heads(q), split_heads(k), split_heads(v), mask, 0.0, is_causal and mask is None
    )
    return context.permute(2, 0, 1, 3).reshape(s, b, width)


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    start: int,
    padding_idx: int | None,
    group: str,
) -> torch.Tensor:
    """Rows of this rank's part of the table (zeros for others' ids), summed over the group."""
    rows = weight.shape[0]
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    local_padding = None
    if padding_idx is not None and start <= padding_idx < start + rows:
        local_padding = padding_idx - start
    out = F.embedding(local, weight, local_padding)
    return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), group)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    vocab_size: int | None,
    group: str,
    tp_size: int,
    tp_rank: int,
) -> torch.Tensor:
    """``F.cross_entropy`` over the ranks' logits joined along the last dim, never gathered:
    the maximum, the softmax denominator and the target's logit are reduced over the group
    (``reduce_from_tp``: the gradient of each rank's share is its own, as the sum's is)."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    local = logits.shape[-1]
    start = tp_rank * local
    vocab = local * tp_size if vocab_size is None else vocab_size
    real = max(0, min(local, vocab - start))  # this rank's columns that are vocabulary
    x = logits.reshape(-1, local).float()  # half and bfloat16 accumulate in float, as eager does
    t = target.reshape(-1).long()
    padding = torch.arange(local, device=x.device) >= real
    if real < local:
        x = x.masked_fill(padding, float("-inf"))
    peak = _ops().all_reduce(x.detach().amax(-1), "max", group)
    shifted = x - peak.unsqueeze(-1)
    log_denominator = reduce_from_tp(shifted.exp().sum(-1), group).log()
    mine = (t >= start) & (t < start + real)
    index = (t - start).clamp(0, local - 1).unsqueeze(-1)
    picked = reduce_from_tp(shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0), group)
    loss = log_denominator - picked
    if label_smoothing > 0:
        total = reduce_from_tp(shifted.masked_fill(padding, 0.0).sum(-1), group)
        loss = (1 - label_smoothing) * loss + label_smoothing * (log_denominator - total / vocab)
    kept = t != ignore_index
    loss = loss.masked_fill(~kept, 0.0)
    if reduction == "none":
        return loss.reshape(target.shape).to(logits.dtype)
    if reduction == "sum":
        return loss.sum().to(logits.dtype)
    if reduction == "mean":
        return (loss.sum() / kept.sum()).to(logits.dtype)
    raise ValueError(
        f"vocab_parallel_cross_entropy: reduction must be mean, sum or none, not {reduction!r}"
    )
