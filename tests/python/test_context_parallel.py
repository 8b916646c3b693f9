"""Context parallelism (torch_mp.context_parallel): a sequence split across the ranks of a
context group. shard_sequence / unshard_sequence cut and join it (load-balanced for causal
masks); attention over the parts by each method ("ring", "all_gather", "all_to_all"), causal
or not, balanced or not, with boolean and float masks where they apply, equals
scaled_dot_product_attention on the whole sequence: outputs and q/k/v gradients, at cp = 2
and 4 (and tp 2 x cp 2). Bad input raises on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import get_world
from reference import error_of, use_mesh

from torch_mp import context_parallel as cp

B, HEADS, SEQ, DIM = 2, 4, 16, 8


def _whole(seed: int, heads: int = HEADS, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(B, heads, seq, DIM, generator=torch.Generator().manual_seed(seed))


def _mask(kind: str | None, seq: int = SEQ) -> torch.Tensor | None:
    """A mask for the whole sequence: none, boolean (a band, every row keeps its diagonal) or
    float (per head, as an additive bias)."""
    if kind is None:
        return None
    if kind == "bool":
        i = torch.arange(seq)
        return (i[:, None] - i[None, :]).abs() <= 5
    return torch.randn(1, HEADS, seq, seq, generator=torch.Generator().manual_seed(9))


def _whole_mask(attn_mask: torch.Tensor | None, is_causal: bool) -> dict:
    """The arguments of SDPA on the whole sequence for a mask within a causal one (which SDPA
    does not take together)."""
    if attn_mask is None or not is_causal:
        return {"attn_mask": attn_mask, "is_causal": is_causal}
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if attn_mask.dtype == torch.bool:
        return {"attn_mask": attn_mask & causal}
    return {"attn_mask": attn_mask.masked_fill(~causal, float("-inf"))}


def _attention_agrees(
    world: int, method: str, is_causal: bool, load_balance: bool, mask: str | None, kv_heads: int
) -> dict[str, float]:
    """Max |difference| of this rank's output and q/k/v gradients from SDPA on the whole
    sequence (its rows of them)."""
    mesh = use_mesh(1, 1, world)
    q, k, v = _whole(1), _whole(2, kv_heads), _whole(3, kv_heads)
    g = _whole(4)  # the gradient of the output
    attn_mask = _mask(mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(
        *leaves, **_whole_mask(attn_mask, is_causal), enable_gqa=kv_heads != HEADS
    )
    expected.backward(g)

    def part(t: torch.Tensor) -> torch.Tensor:
        return cp.shard_sequence(t, 2, load_balance=load_balance)

    mine = [part(t).detach().requires_grad_() for t in (q, k, v)]
    out = cp.attention(
        *mine, is_causal=is_causal, method=method, load_balance=load_balance, attn_mask=attn_mask
    )
    out.backward(part(g))
    differences = {"out": (out - part(expected)).abs().max().item()}
    for name, got, want in zip("qkv", mine, leaves, strict=True):
        differences[f"d{name}"] = (got.grad - part(want.grad)).abs().max().item()
    assert mesh.cp_size == world
    return differences


CASES = [
    (method, causal, balanced, mask)
    for method in cp.METHODS
    for causal in (False, True)
    for balanced in (True, False)
    for mask in ((None,) if method == "ring" else (None, "bool", "float"))
    if causal or balanced  # (without a causal mask the cut does not change the work)
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "method,is_causal,load_balance,mask",
    CASES,
    ids=[
        f"{m}-{'causal' if c else 'full'}-{'balanced' if b else 'plain'}-{k or 'nomask'}"
        for m, c, b, k in CASES
    ],
)
def test_attention_over_the_parts_equals_sdpa_on_the_whole_sequence(
    world, method, is_causal, load_balance, mask
):
    for differences in get_world(world).run(
        _attention_agrees, world, method, is_causal, load_balance, mask, HEADS
    ):
        for name, difference in differences.items():
            assert difference < 1e-5, (name, difference)


@pytest.mark.parametrize("method", cp.METHODS)
def test_grouped_query_attention_over_the_parts_equals_sdpa(method):
    # Two K/V heads for four query heads; all_to_all needs them divisible by cp = 2.
    for differences in get_world(2).run(_attention_agrees, 2, method, True, True, None, 2):
        for name, difference in differences.items():
            assert difference < 1e-5, (name, difference)


def _shard_and_back(world: int, load_balance: bool) -> tuple[list[int], float, float]:
    use_mesh(1, 1, world)
    x = torch.arange(SEQ, dtype=torch.float32).view(1, SEQ, 1).expand(2, SEQ, 3).clone()
    x.requires_grad_()
    part = cp.shard_sequence(x, 1, load_balance=load_balance)
    positions = cp.sequence_positions(SEQ, load_balance=load_balance)
    assert torch.equal(part[0, :, 0], positions.float())  # the positions it holds
    whole = cp.unshard_sequence(part, 1, load_balance=load_balance)
    # Every rank's loss is its own part's sum weighted by (rank + 1): the gradient of x is that
    # weight at the part's positions, zero elsewhere (the adjoint of the cut).
    (part.sum() * (dist.get_rank() + 1)).backward()
    weights = torch.zeros(SEQ)
    weights[positions] = dist.get_rank() + 1
    return (
        positions.tolist(),
        (whole - x).abs().max().item(),
        (x.grad - weights.view(1, SEQ, 1)).abs().max().item(),
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_shard_sequence_cuts_as_documented_and_unshard_joins_it_back(world, load_balance):
    results = get_world(world).run(_shard_and_back, world, load_balance)
    chunk = SEQ // (2 * world if load_balance else world)
    for rank, (positions, joined, grad) in enumerate(results):
        if load_balance:  # chunks r and 2cp - 1 - r
            mirror = 2 * world - 1 - rank
            expected = [*range(rank * chunk, (rank + 1) * chunk)]
            expected += [*range(mirror * chunk, (mirror + 1) * chunk)]
        else:
            expected = [*range(rank * chunk, (rank + 1) * chunk)]
        assert positions == expected
        assert joined == 0 and grad == 0


def _tensor_and_context(method: str) -> dict[str, float]:
    """tp 2 x cp 2: the heads split over the tensor group first (each tensor rank attends with
    its heads), the sequence over the context group."""
    mesh = use_mesh(2, 1, 2)
    q, k, v, g = (_whole(s) for s in (1, 2, 3, 4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(g)
    heads = slice(mesh.tp_rank * HEADS // 2, (mesh.tp_rank + 1) * HEADS // 2)

    def part(t: torch.Tensor) -> torch.Tensor:
        return cp.shard_sequence(t[:, heads], 2)

    mine = [part(t).detach().requires_grad_() for t in (q, k, v)]
    out = cp.attention(*mine, is_causal=True, method=method)
    out.backward(part(g))
    differences = {"out": (out - part(expected)).abs().max().item()}
    for name, got, want in zip("qkv", mine, leaves, strict=True):
        differences[f"d{name}"] = (got.grad - part(want.grad)).abs().max().item()
    return differences


@pytest.mark.parametrize("method", cp.METHODS)
def test_tensor_times_context_parallel_attention_equals_sdpa(method):
    for differences in get_world(4).run(_tensor_and_context, method):
        for name, difference in differences.items():
            assert difference < 1e-5, (name, difference)


def _errors(world: int) -> dict[str, str | None]:
    use_mesh(1, 1, world)
    rank = dist.get_rank()
    q = torch.randn(B, 3, 4, DIM)  # 3 heads: not divisible by cp for all_to_all
    return {
        "not divisible": error_of(cp.shard_sequence, torch.randn(2, 6), 1),
        "heads": error_of(cp.attention, q, q, q, method="all_to_all"),
        "lengths": error_of(cp.shard_sequence, torch.randn(2, 8 * world * (1 + rank)), 1),
        "ring mask": error_of(cp.attention, q, q, q, attn_mask=torch.ones(8, 8, dtype=bool)),
        "method": error_of(cp.attention, q, q, q, method="ulysses"),
        "shapes": error_of(cp.attention, *(torch.randn(B, 4, 4 + 2 * rank, DIM),) * 3),
        # (rank 1's part odd: refused alone, it would leave rank 0 in the agreement)
        "odd part": error_of(
            cp.attention, *(torch.randn(B, 4, 4 + rank, DIM),) * 3, is_causal=True
        ),
        "gathered shapes": error_of(
            cp.attention, *(torch.randn(B, 4, 4 + 2 * rank, DIM),) * 3, method="all_gather"
        ),
        "exchanged shapes": error_of(
            cp.attention, *(torch.randn(B, 4, 4 + 2 * rank, DIM),) * 3, method="all_to_all"
        ),
    }


def test_bad_input_raises_on_every_rank_naming_it():
    for errors in get_world(2).run(_errors, 2):
        assert (
            "must be divisible by 2 * the context-parallel size (4 chunks"
            in errors["not divisible"]
        )
        assert (
            "heads (3) and key/value heads (3) must be divisible by the context-parallel"
            in (errors["heads"])
        )
        assert "shard_sequence: [sequence length, dim]" in errors["lengths"]
        assert "takes is_causal, not an attn_mask" in errors["ring mask"]
        assert "method must be 'ring', 'all_gather' or 'all_to_all'" in errors["method"]
        for key in ("shapes", "gathered shapes", "odd part"):
            assert "then q's, k's and v's dims and sizes" in errors[key], key
        assert "must be the same on every rank of the group" in errors["exchanged shapes"]


class _Tiny(torch.nn.Module):
    """An embedding, a Q/K/V projection, causal attention (given), an output projection."""

    def __init__(self, vocab: int = 11, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, attend, cut=None, join=None) -> torch.Tensor:
        x = self.embedding(tokens)
        x = x if cut is None else cut(x)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        logits = self.out(attend(q, k, v).transpose(1, 2).reshape(b, s, -1))
        return logits if join is None else join(logits)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 11, (4, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _data_and_context(world: int, cp_size: int, method: str, where: str) -> float:
    """One step of _Tiny under torch_mp.DataParallel on (dp, cp) = (world / cp, cp): each data
    rank its rows of the batch, each context rank its part of their sequences, cut where
    ``where`` says: the token ids ("tokens"), the embeddings ("embeddings": the gradient goes
    back through the cut), or the token ids with the logits joined again for a loss over the
    whole sequence on every rank ("joined"). The gradients, averaged over data x context ranks
    (DataParallel's default group), are the one-process model's on the whole batch."""
    import torch_mp

    mesh = use_mesh(1, 1, cp_size)
    inputs, targets = _tokens()
    reference = _Tiny()
    logits = reference(
        inputs, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    model = torch_mp.DataParallel(_Tiny())
    assert model.group is mesh.dp_cp_group
    rows = slice(mesh.dp_rank * 4 // mesh.dp_size, (mesh.dp_rank + 1) * 4 // mesh.dp_size)
    mine = [cp.shard_sequence(t[rows], 1) for t in (inputs, targets)]

    def attend(q, k, v):
        return cp.attention(q, k, v, is_causal=True, method=method)

    if where == "tokens":
        logits, target = model(mine[0], attend), mine[1]
    elif where == "embeddings":
        logits = model(inputs[rows], attend, cut=lambda x: cp.shard_sequence(x, 1))
        target = mine[1]
    else:
        logits = model(mine[0], attend, join=lambda x: cp.unshard_sequence(x, 1))
        target = targets[rows]
    F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    return max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.module.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize("where", ["tokens", "embeddings", "joined"])
@pytest.mark.parametrize(
    "world,cp_size", [(2, 2), (4, 2), (4, 4)], ids=["dp1-cp2", "dp2-cp2", "dp1-cp4"]
)
@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_data_parallel_reduces_over_data_and_context_ranks(world, cp_size, method, where):
    for difference in get_world(world).run(_data_and_context, world, cp_size, method, where):
        assert difference < 1e-5, difference


def _ring_in(dtype: torch.dtype) -> float:
    """The ring in float64 (the explicit block path) or bfloat16 (fused blocks, fp32
    accumulation) against SDPA on the whole sequence in float64."""
    use_mesh(1, 1, 2)
    q, k, v, g = (_whole(s).double() for s in (1, 2, 3, 4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(g)
    mine = [cp.shard_sequence(t, 2).to(dtype).requires_grad_() for t in (q, k, v)]
    out = cp.attention(*mine, is_causal=True)
    out.backward(cp.shard_sequence(g, 2).to(dtype))
    worst = (out.double() - cp.shard_sequence(expected, 2)).abs().max().item()
    for got, want in zip(mine, leaves, strict=True):
        worst = max(worst, (got.grad.double() - cp.shard_sequence(want.grad, 2)).abs().max().item())
    return worst


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 5e-2)])
def test_the_ring_in_other_dtypes(dtype, tolerance):
    # bf16 holds 8 bits of mantissa: 5e-2 on values of order 1 is a few of its roundings.
    for worst in get_world(2).run(_ring_in, dtype):
        assert worst < tolerance, worst
