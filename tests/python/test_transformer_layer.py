"""ParallelTransformerLayer against nn.TransformerEncoderLayer on one process (with and without
sequence parallelism, post- and pre-LN, masks), its dropout streams, and deepcopy of the
modules sharing their group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, rank_tensor, use_mesh
from torch import nn

import torch_mp

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


def _qkv_rows(dense_grad: torch.Tensor, t: int, r: int) -> torch.Tensor:
    """This rank's heads of a [3h, ...] in-projection tensor: rows of each of Q, K and V."""
    return torch.cat([part.chunk(t, 0)[r] for part in dense_grad.chunk(3, 0)])


def _transformer_layer_matches_dense(sequence_parallel: bool, norm_first: bool, mask: str) -> None:
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    seq = SEQ_PER_RANK * 4  # divisible by 1, 2 and 4
    torch.manual_seed(0)
    dense = nn.TransformerEncoderLayer(
        HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", norm_first=norm_first
    )
    with torch.no_grad():  # non-trivial LayerNorm parameters
        for p in (dense.norm1.weight, dense.norm1.bias, dense.norm2.weight, dense.norm2.bias):
            p.add_(torch.randn_like(p) * 0.1)
    x, g = rank_tensor(1, 0, seq, BATCH, HIDDEN), rank_tensor(2, 0, seq, BATCH, HIDDEN)
    causal = nn.Transformer.generate_square_subsequent_mask(seq)
    dense_kwargs = {"src_mask": causal, "is_causal": True} if mask == "causal" else {}
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref, **dense_kwargs)
    y_ref.backward(g)

    layer = torch_mp.ParallelTransformerLayer.from_dense(dense, sequence_parallel=sequence_parallel)
    mine = (lambda v: v.chunk(t, 0)[r]) if sequence_parallel else (lambda v: v)
    x_par = mine(x).clone().requires_grad_()
    kwargs = {"is_causal": True} if mask == "causal" else {}
    if mask == "bool":
        kwargs = {"attn_mask": torch.ones(seq, seq, dtype=torch.bool).triu(1)}
        y_ref = dense(x, src_mask=kwargs["attn_mask"])
    y = layer(x_par, **kwargs)
    y.backward(mine(g))

    assert_close(y, mine(y_ref.detach()), "output")
    if mask == "bool":
        return
    assert_close(x_par.grad, mine(x_ref.grad), "input gradient", GRAD_ATOL)
    attn, mlp = layer.self_attn, layer.mlp
    expected = {
        "qkv weight": (attn.qkv.weight.grad, _qkv_rows(dense.self_attn.in_proj_weight.grad, t, r)),
        "qkv bias": (attn.qkv.bias.grad, _qkv_rows(dense.self_attn.in_proj_bias.grad, t, r)),
        "proj weight": (attn.proj.weight.grad, dense.self_attn.out_proj.weight.grad.chunk(t, 1)[r]),
        "proj bias": (attn.proj.bias.grad, dense.self_attn.out_proj.bias.grad),
        "fc1 weight": (mlp.fc1.weight.grad, dense.linear1.weight.grad.chunk(t, 0)[r]),
        "fc2 weight": (mlp.fc2.weight.grad, dense.linear2.weight.grad.chunk(t, 1)[r]),
        "fc2 bias": (mlp.fc2.bias.grad, dense.linear2.bias.grad),
        "norm1 weight": (layer.norm1.weight.grad, dense.norm1.weight.grad),
        "norm1 bias": (layer.norm1.bias.grad, dense.norm1.bias.grad),
        "norm2 weight": (layer.norm2.weight.grad, dense.norm2.weight.grad),
        "norm2 bias": (layer.norm2.bias.grad, dense.norm2.bias.grad),
    }
    for what, (actual, want) in expected.items():
        assert_close(actual, want, f"{what} gradient", GRAD_ATOL)


@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_transformer_layer_matches_dense(world, sequence_parallel, norm_first):
    world.run(_transformer_layer_matches_dense, sequence_parallel, norm_first, "causal")


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_transformer_layer_masks(world4, mask):
    world4.run(_transformer_layer_matches_dense, True, False, mask)


def _three_d_mask_and_dropout() -> None:
    """A [b * num_heads, s, s] mask (each head its own) as nn.MultiheadAttention takes it; and
    dropout in training: replicated outputs stay identical across ranks (shared stream), while
    the shards draw from the per-rank stream."""
    mesh = use_mesh(dist.get_world_size())
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(HIDDEN, HEADS)
    seq = 6
    x = rank_tensor(1, 0, seq, BATCH, HIDDEN)
    mask = torch.rand(BATCH * HEADS, seq, seq, generator=torch.Generator().manual_seed(5)) > 0.6
    mask[:, :, 0] = False  # every query may attend somewhere
    expected, _ = attention(x, x, x, attn_mask=mask, need_weights=False)
    parallel = torch_mp.ParallelSelfAttention.from_dense(attention)
    assert_close(parallel(x, attn_mask=mask), expected, "3-d mask output")

    torch_mp.random.manual_seed(11)
    layer = torch_mp.ParallelTransformerLayer(HIDDEN, HEADS, FFN, dropout=0.3)
    y = layer(x)
    everyone = [torch.empty_like(y) for _ in range(mesh.tp_size)]
    dist.all_gather(everyone, y.detach())
    for other in everyone:
        assert torch.equal(other, y), "replicated output differs between ranks"
    layer.eval()
    assert not torch.equal(layer(x), y), "dropout had no effect in training"


def test_three_d_masks_and_dropout(world):
    world.run(_three_d_mask_and_dropout)


def _deepcopy_shares_the_group() -> None:
    """copy.deepcopy (EMA copies, pipeline partition profiling) copies parameters and shares the
    process group."""
    import copy

    use_mesh(dist.get_world_size())
    torch.manual_seed(0)
    layer = torch_mp.ParallelTransformerLayer(HIDDEN, HEADS, FFN, dropout=0.0)
    conv = torch_mp.ColumnParallelConv2d(3, 8, 3, gather_output=True)
    for module, x in ((layer, rank_tensor(1, 0, 4, 2, HIDDEN)), (conv, torch.ones(1, 3, 5, 5))):
        clone = copy.deepcopy(module)
        assert clone.group is module.group
        assert all(a is not b for a, b in zip(clone.parameters(), module.parameters(), strict=True))
        assert torch.equal(clone(x), module(x))


def test_deepcopy_shares_the_group(world):
    world.run(_deepcopy_shares_the_group)
