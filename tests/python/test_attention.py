"""ParallelSelfAttention against nn.MultiheadAttention: from_dense / to_dense, default
initialisation and softmax_scale."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, rank_tensor, use_mesh
from torch import nn

import torch_mp
from torch_mp import context_parallel as cp

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


def _attention_round_trip() -> None:
    """from_dense / to_dense of the attention, and default init equal to the seeded dense
    nn.MultiheadAttention."""
    use_mesh(dist.get_world_size())
    torch.manual_seed(1)
    attention = nn.MultiheadAttention(HIDDEN, HEADS)
    back = torch_mp.ParallelSelfAttention.from_dense(attention).to_dense()
    for name, p in attention.named_parameters():
        assert torch.equal(dict(back.named_parameters())[name], p), name
    torch.manual_seed(2)
    drawn = torch_mp.ParallelSelfAttention(HIDDEN, HEADS).to_dense()
    torch.manual_seed(2)
    seeded = nn.MultiheadAttention(HIDDEN, HEADS)
    for name, p in seeded.named_parameters():
        assert torch.equal(dict(drawn.named_parameters())[name], p), name


def test_attention_from_and_to_dense(world):
    world.run(_attention_round_trip)


def _q_scaled(attention: nn.MultiheadAttention, factor: float) -> nn.MultiheadAttention:
    """A copy of ``attention`` whose queries are ``factor`` times larger (its scores too)."""
    scaled = copy.deepcopy(attention)
    with torch.no_grad():
        scaled.in_proj_weight[:HIDDEN] *= factor
        scaled.in_proj_bias[:HIDDEN] *= factor
    return scaled


def _softmax_scale_multiplies_the_scores(method: str) -> None:
    """softmax_scale = s takes softmax(q k^T s): the dense attention whose queries are
    s sqrt(head_dim) times larger, over the tensor group, with dropout (the explicit softmax)
    and over a context group."""
    n = dist.get_world_size()
    mesh = use_mesh(n, 1, 1) if method == "tp" else use_mesh(1, 1, n)
    scale, seq = 0.37, 4 * SEQ_PER_RANK
    torch.manual_seed(3)
    dense = nn.MultiheadAttention(HIDDEN, HEADS)
    reference = _q_scaled(dense, scale * math.sqrt(HIDDEN // HEADS))
    x = rank_tensor(1, 0, seq, BATCH, HIDDEN)
    causal = nn.Transformer.generate_square_subsequent_mask(seq)
    want = reference(x, x, x, attn_mask=causal, need_weights=False)[0]
    if method == "tp":
        layer = torch_mp.ParallelSelfAttention.from_dense(dense, softmax_scale=scale)
        assert_close(layer(x, is_causal=True), want, "output")
        # With dropout: the same masks (one seed) over the scores scaled either way.
        dropped = {}
        for name, module in ("scale", dense), ("queries", reference):
            parallel = torch_mp.ParallelSelfAttention.from_dense(
                module, softmax_scale=scale if name == "scale" else None
            )
            parallel.dropout = 0.5
            torch_mp.random.manual_seed(11)
            dropped[name] = parallel(x, is_causal=True)
        assert_close(dropped["scale"], dropped["queries"], "output with dropout")
    else:
        layer = torch_mp.ParallelSelfAttention.from_dense(
            dense, context_parallel=True, context_method=method, softmax_scale=scale
        )
        y = layer(cp.shard_sequence(x, 0, group=mesh.cp_group), is_causal=True)
        assert_close(y, cp.shard_sequence(want, 0, group=mesh.cp_group), "output")


@pytest.mark.parametrize("method", ["tp", "ring", "all_gather"])
def test_softmax_scale_multiplies_the_scores(world, method):
    world.run(_softmax_scale_multiplies_the_scores, method)


def _a_transformer_layer_hands_its_softmax_scale_to_its_attention() -> None:
    use_mesh(dist.get_world_size())
    torch.manual_seed(4)
    dense = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0)
    reference = copy.deepcopy(dense)
    reference.self_attn = _q_scaled(dense.self_attn, 2.0 * math.sqrt(HIDDEN // HEADS))
    layer = torch_mp.ParallelTransformerLayer.from_dense(dense, softmax_scale=2.0)
    x = rank_tensor(2, 0, 4 * SEQ_PER_RANK, BATCH, HIDDEN)
    assert layer.self_attn.softmax_scale == 2.0
    assert_close(layer(x), reference(x), "output")


def test_a_transformer_layer_hands_its_softmax_scale_to_its_attention(world):
    world.run(_a_transformer_layer_hands_its_softmax_scale_to_its_attention)
