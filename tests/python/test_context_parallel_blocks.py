"""The blocks under context parallelism: ParallelSelfAttention and ParallelTransformerLayer with
context_parallel=True, each rank holding its part of the sequence, equal the dense layer on the
whole sequence (outputs, input gradients, and parameter gradients summed over the context
ranks), by each method, at cp = 2 and 4 and with tp 2 x cp 2 (heads split first, sequence
parallelism inside), with recomputation and whole-sequence masks; vocab_parallel_cross_entropy
with context_parallel=True is the mean over the whole sequence; bad settings raise on every
rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn
from torch.nn import functional as F

import torch_mp
from torch_mp import context_parallel as cp

SEQ, BATCH, HIDDEN, HEADS, FFN = 16, 2, 16, 4, 32
# Gradients are sums over s x b positions, here also over the context ranks (in another order):
# entries near zero differ by a few ulps of the summed terms (as test_transformer_layer.py).
GRAD_ATOL = 1e-5


def _dense_gradients(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The parallel layer's gradients, summed over the context group, in the dense layer's
    names (to_dense of a copy whose values are the gradients; a collective)."""
    shadow = copy.deepcopy(layer)
    with torch.no_grad():
        for mine, theirs in zip(shadow.parameters(), layer.parameters(), strict=True):
            grad = theirs.grad.clone()
            dist.all_reduce(grad, group=layer.self_attn.context_group)
            mine.copy_(grad)
    return shadow.to_dense().state_dict()


def _layer_agrees(tp: int, cp_size: int, method: str, options: dict) -> None:
    sequence_parallel = options.get("sequence_parallel", False)
    load_balance = options.get("load_balance", True)
    mask = options.get("mask", "causal")
    mesh = use_mesh(tp, 1, cp_size)
    torch.manual_seed(0)
    dense = nn.TransformerEncoderLayer(
        HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", norm_first=True
    )
    with torch.no_grad():  # non-trivial LayerNorm parameters
        for p in (dense.norm1.weight, dense.norm1.bias, dense.norm2.weight, dense.norm2.bias):
            p.add_(torch.randn_like(p) * 0.1)
    x, g = rank_tensor(1, 0, SEQ, BATCH, HIDDEN), rank_tensor(2, 0, SEQ, BATCH, HIDDEN)
    if mask == "causal":
        dense_kwargs = {"src_mask": nn.Transformer.generate_square_subsequent_mask(SEQ)}
        kwargs = {"is_causal": True}
    elif mask == "float":  # a whole-sequence additive mask, as nn.MultiheadAttention takes it
        bias = rank_tensor(3, 0, SEQ, SEQ)
        dense_kwargs, kwargs = {"src_mask": bias}, {"attn_mask": bias}
    else:  # boolean, True may not attend: a band around the diagonal
        i = torch.arange(SEQ)
        band = (i[:, None] - i[None, :]).abs() > 5
        dense_kwargs, kwargs = {"src_mask": band}, {"attn_mask": band}
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref, **dense_kwargs)
    y_ref.backward(g)

    layer = torch_mp.ParallelTransformerLayer.from_dense(
        dense,
        sequence_parallel=sequence_parallel,
        recompute=options.get("recompute"),
        context_parallel=True,
        context_method=method,
        load_balance=load_balance,
    )
    assert layer.self_attn.context_group is mesh.cp_group

    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's rows: its part, then its chunk
        part = cp.shard_sequence(t, 0, load_balance=load_balance)
        return part.chunk(tp, 0)[mesh.tp_rank] if sequence_parallel else part

    x_par = mine(x).clone().requires_grad_()
    y = layer(x_par, **kwargs)
    y.backward(mine(g))
    assert_close(y, mine(y_ref.detach()), "output")
    assert_close(x_par.grad, mine(x_ref.grad), "input gradient", GRAD_ATOL)
    want = dict(dense.named_parameters())
    for name, grad in _dense_gradients(layer).items():
        assert_close(grad, want[name].grad, f"{name} gradient", GRAD_ATOL)


LAYER_CASES = {
    # id: (world, tp, cp, method, keyword arguments)
    "cp2-ring": (2, 1, 2, "ring", {}),
    "cp2-all_gather": (2, 1, 2, "all_gather", {}),
    "cp2-all_to_all": (2, 1, 2, "all_to_all", {}),
    "cp2-ring-plain": (2, 1, 2, "ring", {"load_balance": False}),
    "cp2-ring-selective": (2, 1, 2, "ring", {"recompute": "selective"}),
    "cp2-all_gather-full": (2, 1, 2, "all_gather", {"recompute": "full"}),
    "cp2-all_gather-float-mask": (2, 1, 2, "all_gather", {"mask": "float"}),
    "cp2-all_to_all-bool-mask": (2, 1, 2, "all_to_all", {"mask": "bool"}),
    "cp4-ring": (4, 1, 4, "ring", {}),
    "cp4-all_to_all": (4, 1, 4, "all_to_all", {}),
    "tp2-cp2-ring-sp": (4, 2, 2, "ring", {"sequence_parallel": True}),
    "tp2-cp2-all_to_all": (4, 2, 2, "all_to_all", {}),
    "tp2-cp2-all_gather-sp-float-mask": (
        4,
        2,
        2,
        "all_gather",
        {"sequence_parallel": True, "mask": "float"},
    ),
}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_context_parallel_transformer_layer_equals_the_dense_layer(case):
    world, tp, cp_size, method, kwargs = LAYER_CASES[case]
    get_world(world).run(_layer_agrees, tp, cp_size, method, kwargs)


def _cross_entropy_agrees(tp: int, cp_size: int, reduction: str) -> None:
    """Logits [s, b, V / t] of this rank's part of the sequence; some targets ignored, more on
    one part than another, so that a mean of the ranks' means would differ."""
    mesh = use_mesh(tp, 1, cp_size)
    vocab = 12
    logits = rank_tensor(4, 0, SEQ, BATCH, vocab)
    target = torch.randint(0, vocab, (SEQ, BATCH), generator=torch.Generator().manual_seed(6))
    target[: SEQ // 4] = -100
    whole = logits.clone().requires_grad_()
    expected = F.cross_entropy(whole.flatten(0, 1), target.flatten(), reduction=reduction)
    expected.backward()

    part = cp.shard_sequence(logits, 0).chunk(tp, -1)[mesh.tp_rank].clone().requires_grad_()
    loss = torch_mp.vocab_parallel_cross_entropy(
        part, cp.shard_sequence(target, 0), reduction=reduction, context_parallel=True
    )
    loss.backward()
    assert_close(loss, expected.detach(), "loss")
    # The adjoint of the sum over the context ranks: cp times this part's gradient, which
    # DataParallel's average over data x context ranks divides again.
    want = cp.shard_sequence(whole.grad, 0).chunk(tp, -1)[mesh.tp_rank] * cp_size
    assert_close(part.grad, want, "logits gradient")


@pytest.mark.parametrize(
    "world,tp,cp_size,reduction",
    [(2, 1, 2, "mean"), (2, 1, 2, "sum"), (4, 1, 4, "mean"), (4, 2, 2, "mean")],
    ids=["cp2-mean", "cp2-sum", "cp4-mean", "tp2-cp2-mean"],
)
def test_cross_entropy_is_the_mean_over_the_whole_sequence(world, tp, cp_size, reduction):
    get_world(world).run(_cross_entropy_agrees, tp, cp_size, reduction)


def _errors() -> dict[str, str | None]:
    mesh = use_mesh(1, 1, 2)
    x = torch.randn(SEQ // 2, BATCH, HIDDEN)
    with_dropout = torch_mp.ParallelTransformerLayer(
        HIDDEN, HEADS, FFN, dropout=0.1, context_parallel=True
    )
    attention = torch_mp.ParallelSelfAttention(HIDDEN, HEADS, context_parallel=True)
    errors = {
        "dropout": error_of(with_dropout, x, is_causal=True),
        "group without cp": error_of(
            torch_mp.ParallelSelfAttention, HIDDEN, HEADS, context_group=mesh.cp_group
        ),
        "method": error_of(
            torch_mp.ParallelSelfAttention,
            HIDDEN,
            HEADS,
            context_parallel=True,
            context_method="ulysses",
        ),
        # A mask of this rank's part, not of the whole sequence.
        "mask": error_of(attention, x, attn_mask=torch.zeros(SEQ // 2, SEQ // 2)),
        "ring mask": error_of(attention, x, attn_mask=torch.zeros(SEQ, SEQ)),
        "disagree": error_of(
            torch_mp.ParallelSelfAttention,
            HIDDEN,
            HEADS,
            context_parallel=True,
            context_method=("ring", "all_gather")[mesh.cp_rank],
        ),
    }
    layer = torch_mp.ParallelTransformerLayer(
        HIDDEN, HEADS, FFN, dropout=0.0, context_parallel=True
    )
    three_heads = torch_mp.ParallelSelfAttention(
        12, 3, context_parallel=True, context_method="all_to_all"
    )
    rank = mesh.cp_rank
    errors["lengths"] = error_of(layer, torch.randn(SEQ // 2 + 2 * rank, BATCH, HIDDEN), None, True)
    errors["odd part"] = error_of(layer, torch.randn(7, BATCH, HIDDEN), None, True)
    errors["heads"] = error_of(three_heads, torch.randn(8, BATCH, 12), None, True)
    with_dropout.eval()  # (dropout is fine outside training)
    assert with_dropout(x, is_causal=True).shape == x.shape
    return errors


def test_bad_context_parallel_settings_raise_on_every_rank():
    for errors in get_world(2).run(_errors):
        assert "under context parallelism is not supported in training" in errors["dropout"]
        assert "a context_group is given but context_parallel is off" in errors["group without cp"]
        assert "context_method must be 'ring', 'all_gather' or 'all_to_all'" in errors["method"]
        assert "(s the whole sequence under context parallelism)" in errors["mask"]
        assert "takes is_causal, not an attn_mask" in errors["ring mask"]
        assert "configuration must be the same" in errors["disagree"]
        assert "context_method (here " in errors["disagree"]
        assert "then q's, k's and v's dims and sizes" in errors["lengths"]
        assert "a load-balanced part holds two chunks; its length (7) is odd" in errors["odd part"]
        assert "the heads (3) and key/value heads (3) must be divisible" in errors["heads"]


def _attention_agrees(method: str) -> None:
    """ParallelSelfAttention.from_dense(..., context_parallel=True) against
    nn.MultiheadAttention on the whole sequence under a causal mask."""
    use_mesh(1, 1, 2)
    torch.manual_seed(0)
    dense = nn.MultiheadAttention(HIDDEN, HEADS)
    x, g = rank_tensor(1, 0, SEQ, BATCH, HIDDEN), rank_tensor(2, 0, SEQ, BATCH, HIDDEN)
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ)
    x_ref = x.clone().requires_grad_()
    y_ref, _ = dense(x_ref, x_ref, x_ref, attn_mask=causal, need_weights=False)
    y_ref.backward(g)
    parallel = torch_mp.ParallelSelfAttention.from_dense(
        dense, context_parallel=True, context_method=method
    )
    x_par = cp.shard_sequence(x, 0).requires_grad_()
    y = parallel(x_par, is_causal=True)
    y.backward(cp.shard_sequence(g, 0))
    assert_close(y, cp.shard_sequence(y_ref.detach(), 0), "output")
    assert_close(x_par.grad, cp.shard_sequence(x_ref.grad, 0), "input gradient", GRAD_ATOL)
    grad = parallel.qkv.weight.grad.clone()
    dist.all_reduce(grad, group=parallel.context_group)
    assert_close(grad, dense.in_proj_weight.grad, "in-projection gradient", GRAD_ATOL)


@pytest.mark.parametrize("method", cp.METHODS)
def test_context_parallel_self_attention_from_dense_equals_multihead_attention(method):
    get_world(2).run(_attention_agrees, method)
