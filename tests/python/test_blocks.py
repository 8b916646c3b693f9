"""The parallel building blocks against their dense counterparts on one process:
nn.MultiheadAttention, torch_mp.dense.MLP, nn.TransformerEncoderLayer (with and without sequence
parallelism, post- and pre-LN) and torch_mp.dense.ConvBlock."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp
from torch_mp.tensor_parallel import LayerNorm

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


def _layer_norm_gradients_need_the_sum() -> None:
    """Under sequence parallelism a plain nn.LayerNorm gets only its own rows' gradient; the
    torch_mp LayerNorm gets the dense one (the sum over the group)."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(0)
    dense = nn.LayerNorm(HIDDEN)
    x = rank_tensor(1, 0, 4 * t, BATCH, HIDDEN)
    dense(x).pow(2).sum().backward()
    sp = LayerNorm.from_dense(dense, sequence_parallel=True)
    sp(x.chunk(t, 0)[r]).pow(2).sum().backward()
    assert_close(sp.weight.grad, dense.weight.grad, "weight gradient", GRAD_ATOL)
    assert_close(sp.bias.grad, dense.bias.grad, "bias gradient", GRAD_ATOL)
    with torch.no_grad():
        dense.weight.add_(1.0)
    assert not torch.equal(sp.weight, dense.weight), "from_dense must copy, not share"


def test_sequence_parallel_layer_norm_gradients_equal_dense(world):
    world.run(_layer_norm_gradients_need_the_sum)


def _attention_and_mlp_round_trip() -> None:
    """from_dense / to_dense of the attention, default init equal to the seeded dense modules,
    and the MLP against torch_mp.dense.MLP."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
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

    torch.manual_seed(3)
    mlp = torch_mp.dense.MLP(HIDDEN, FFN, activation="relu")
    x = rank_tensor(3, 0, 5, BATCH, HIDDEN)
    mlp(x).sum().backward()
    parallel = torch_mp.ParallelMLP.from_dense(mlp)
    y = parallel(x)
    y.sum().backward()
    assert_close(y, mlp(x), "MLP output")
    assert_close(parallel.fc1.weight.grad, mlp.fc1.weight.grad.chunk(t, 0)[r], "fc1", GRAD_ATOL)
    assert_close(parallel.fc2.weight.grad, mlp.fc2.weight.grad.chunk(t, 1)[r], "fc2", GRAD_ATOL)


def test_attention_and_mlp_from_and_to_dense(world):
    world.run(_attention_and_mlp_round_trip)


def _conv_block_matches_dense() -> None:
    """Training mode: output, input gradient, every parameter gradient and the BatchNorm running
    statistics (each rank's channels) equal the dense block's."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(0)
    dense = torch_mp.dense.ConvBlock(3, 8, 5, kernel_size=3)
    parallel = torch_mp.ParallelConvBlock.from_dense(dense)
    x, g = rank_tensor(1, 0, 2, 3, 9, 9), rank_tensor(2, 0, 2, 5, 9, 9)
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref)
    y_ref.backward(g)
    x_par = x.clone().requires_grad_()
    y = parallel(x_par)
    y.backward(g)
    assert_close(y, y_ref, "output")
    assert_close(x_par.grad, x_ref.grad, "input gradient", GRAD_ATOL)
    pairs = [
        (parallel.conv1.weight.grad, dense.conv1.weight.grad.chunk(t, 0)[r], "conv1 weight"),
        (parallel.conv1.bias.grad, dense.conv1.bias.grad.chunk(t, 0)[r], "conv1 bias"),
        (parallel.norm.weight.grad, dense.norm.weight.grad.chunk(t, 0)[r], "norm weight"),
        (parallel.norm.bias.grad, dense.norm.bias.grad.chunk(t, 0)[r], "norm bias"),
        (parallel.conv2.weight.grad, dense.conv2.weight.grad.chunk(t, 1)[r], "conv2 weight"),
        (parallel.conv2.bias.grad, dense.conv2.bias.grad, "conv2 bias"),
        (parallel.norm.running_mean, dense.norm.running_mean.chunk(t, 0)[r], "running mean"),
        (parallel.norm.running_var, dense.norm.running_var.chunk(t, 0)[r], "running var"),
    ]
    for actual, want, what in pairs:
        assert_close(actual, want, what, GRAD_ATOL)
    parallel.eval()
    dense.eval()
    assert_close(parallel(x), dense(x), "eval output")


def test_conv_block_matches_dense(world):
    world.run(_conv_block_matches_dense)


def _indivisible_blocks() -> list[str | None]:
    use_mesh(dist.get_world_size())
    return [
        error_of(torch_mp.ParallelSelfAttention, 12, 6),
        error_of(torch_mp.ParallelTransformerLayer, 16, 4, 30),
        error_of(torch_mp.ParallelConvBlock, 3, 6, 5),
        error_of(torch_mp.ParallelSelfAttention, 12, 5),
    ]


def test_head_and_channel_counts_not_divisible_raise(world4):
    for heads, ffn, channels, head_dim in world4.run(_indivisible_blocks):
        assert "num_heads (6) must be divisible by the tensor-parallel size (4)" in heads
        assert "ffn_hidden_size (30) must be divisible by the tensor-parallel size (4)" in ffn
        assert "mid_channels (6) must be divisible by the tensor-parallel size (4)" in channels
        assert "hidden_size (12) must be divisible by num_heads (5)" in head_dim


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


def _default_init_equals_seeded_dense() -> None:
    """Ranks seeded alike hold parts of the dense module the same seed gives."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(6)
    layer = torch_mp.ParallelTransformerLayer(HIDDEN, HEADS, FFN, norm_first=True)
    torch.manual_seed(6)
    dense = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, norm_first=True)
    back = layer.self_attn.to_dense()
    assert torch.equal(back.in_proj_weight, dense.self_attn.in_proj_weight)
    assert torch.equal(layer.mlp.fc1.weight, dense.linear1.weight.chunk(t, 0)[r])
    assert torch.equal(layer.mlp.fc2.weight, dense.linear2.weight.chunk(t, 1)[r])
    torch.manual_seed(7)
    block = torch_mp.ParallelConvBlock(3, 8, 5)
    torch.manual_seed(7)
    dense_block = torch_mp.dense.ConvBlock(3, 8, 5)
    assert torch.equal(block.conv1.to_dense().weight, dense_block.conv1.weight)
    assert torch.equal(block.conv2.to_dense().bias, dense_block.conv2.bias)
    torch.manual_seed(8)
    mlp = torch_mp.ParallelMLP(HIDDEN, FFN)
    torch.manual_seed(8)
    dense_mlp = torch_mp.dense.MLP(HIDDEN, FFN)
    assert torch.equal(mlp.fc2.to_dense().weight, dense_mlp.fc2.weight)


def test_default_init_equals_the_seeded_dense_modules(world):
    world.run(_default_init_equals_seeded_dense)


def _block_config_differs_between_ranks() -> list[str | None]:
    use_mesh(dist.get_world_size())
    first = dist.get_rank() == 0
    tanh = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, activation=nn.GELU(approximate="tanh"))
    return [
        error_of(torch_mp.ParallelTransformerLayer, HIDDEN, HEADS, FFN, norm_first=first),
        error_of(torch_mp.ParallelMLP, HIDDEN, FFN, activation="gelu" if first else "swish"),
        error_of(torch_mp.ParallelSelfAttention, HIDDEN, HEADS, dropout=0.1 if first else 0.0),
        error_of(torch_mp.ParallelTransformerLayer.from_dense, tanh),
    ]


def test_block_configs_that_differ_between_ranks_raise_on_every_rank(world2):
    for norm_first, activation, dropout, tanh in world2.run(_block_config_differs_between_ranks):
        assert "ParallelTransformerLayer configuration [norm_first" in norm_first
        assert "ParallelMLP configuration" in activation and "same on every rank" in activation
        assert "ParallelSelfAttention configuration" in dropout
        assert "only relu and (exact) gelu" in tanh


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


def _region_dropout_streams() -> None:
    """Dropout on shards draws from the per-rank stream (masks differ between ranks), dropout on
    replicated tensors from the shared one (masks equal)."""
    mesh = use_mesh(dist.get_world_size())
    torch_mp.random.manual_seed(3)
    ones = torch.ones(4096)
    shard_mask = torch_mp.random.region_dropout(ones, 0.5, True)
    replicated_mask = torch.nn.functional.dropout(ones, 0.5, True)
    masks = [torch.empty_like(ones) for _ in range(mesh.tp_size)]
    dist.all_gather(masks, shard_mask)
    if mesh.tp_size > 1:
        assert not torch.equal(masks[0], masks[1]), "shards drew the same dropout mask"
    dist.all_gather(masks, replicated_mask)
    assert all(torch.equal(m, replicated_mask) for m in masks), "replicated masks differ"


def test_dropout_draws_from_the_right_stream(world):
    world.run(_region_dropout_streams)
