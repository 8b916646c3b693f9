"""torch.compile(fullgraph=True) of tensor-parallel modules: the MLP (Column -> GELU -> Row), the
parallel transformer layer (tensor and sequence parallel, causal or with a mask, with dropout in
training), the convolutional block and channel-parallel convolutions (padding modes included)
and the vocabulary-parallel loss trace into one graph (torch._dynamo.explain: no graph break)
through the core's operators (torch.ops.torch_mp.*, the same ones eager code runs), and equal
eager: outputs and gradients, rtol 1e-5 (the compiled graph may fuse and reorder elementwise
work), recomputation (the layer's option, torch.utils.checkpoint) with dropout included. The
core's checks that read values (ids, targets) hold in compiled code too."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import error_of, use_mesh
from torch import nn

import torch_mp
from torch_mp import context_parallel as cp
from torch_mp import dense

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _no_graph_break(fn, *args) -> None:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def _compiled_equals_eager(
    module: nn.Module,
    loss_of,
    *inputs,
    seed: int | None = None,
    compiled_module: nn.Module | None = None,
) -> None:
    """With ``seed``, both runs start from ``torch_mp.random.manual_seed(seed)`` (dropout). The
    compiled module is a copy of ``module``, or ``compiled_module`` (the same parameters)."""
    eager = module
    if compiled_module is None:
        compiled_module = copy.deepcopy(module)
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    grads = []
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
        if seed is not None:
            torch_mp.random.manual_seed(seed)
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = model(*xs)
        loss_of(out).backward()
        grads.append(
            (
                out.detach(),
                [x.grad for x in xs if x.requires_grad],
                [p.grad for p in model.parameters()],
            )
        )
    (out_e, in_e, par_e), (out_c, in_c, par_c) = grads
    torch.testing.assert_close(out_c, out_e, **TOL)
    for a, b in zip(in_c + par_c, in_e + par_e, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _mlp(tp: int) -> None:
    use_mesh(tp)
    torch.manual_seed(0)
    mlp = torch_mp.ParallelMLP.from_dense(dense.MLP(16, 32))
    x = torch.randn(4, 16)
    _no_graph_break(mlp, x)
    _compiled_equals_eager(mlp, lambda y: y.square().sum(), x)
    # Further batch sizes: the graph is recompiled with dynamic shapes.
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    for rows in (4, 6, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), mlp(x), **TOL)


class _Causal(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, is_causal=True)


def _transformer_layer(tp: int, sequence_parallel: bool) -> None:
    use_mesh(tp)
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, norm_first=True)
    parallel = torch_mp.ParallelTransformerLayer.from_dense(
        layer, sequence_parallel=sequence_parallel
    )
    s = 8
    x = torch.randn(s, 2, 16)
    if sequence_parallel:  # this rank's chunk of the sequence
        x = x.chunk(tp)[dist.get_rank()].contiguous()
    _no_graph_break(lambda x: parallel(x, is_causal=True), x)

    _compiled_equals_eager(_Causal(parallel), lambda y: y.square().sum(), x)


class _Masked(nn.Module):
    def __init__(self, inner, mask):
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x):
        return self.inner(x, self.mask)


def _transformer_layer_mask_and_dropout(tp: int, sequence_parallel: bool) -> None:
    """An attention mask ([s, s] bool and [b * heads, s, s] float), and dropout in training
    (attention probabilities and MLP from the per-rank stream, residuals from the shared or,
    under sequence parallelism, the per-rank one): the compiled layer draws what eager draws."""
    use_mesh(tp)
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.25)
    parallel = torch_mp.ParallelTransformerLayer.from_dense(
        layer, sequence_parallel=sequence_parallel
    )
    s, b = 8, 2
    x = torch.randn(s, b, 16)
    if sequence_parallel:
        x = x.chunk(tp)[dist.get_rank()].contiguous()
    boolean = torch.ones(s, s, dtype=torch.bool).triu(1)
    per_head = torch.randn(b * 4, s, s)
    for mask in (boolean, per_head):
        _no_graph_break(lambda x, mask=mask: parallel(x, mask), x)
        _compiled_equals_eager(_Masked(parallel, mask), lambda y: y.square().sum(), x, seed=5)
    wrong = torch.zeros(s + 1, s + 1, dtype=torch.bool)
    compiled = torch.compile(_Masked(parallel, wrong), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="attn_mask must be"):
        compiled(x)


class _Checkpointed(nn.Module):
    """``inner`` under torch.utils.checkpoint (non-reentrant), causal."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(
            lambda x: self.inner(x, is_causal=True), x, use_reentrant=False
        )


def _transformer_layer_recompute(tp: int, sequence_parallel: bool) -> None:
    """With dropout from both streams, the layer's recompute options compile (the core's
    recomputation becomes a checkpointed region of the traced graph) and so does
    torch.utils.checkpoint around the layer; each equals the eager layer that keeps its
    activations, gradients included: the compiled backward recomputes all but the per-rank
    stream's noise, which it saves."""
    use_mesh(tp)
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.25)
    kept = torch_mp.ParallelTransformerLayer.from_dense(layer, sequence_parallel=sequence_parallel)
    x = torch.randn(8, 2, 16)
    if sequence_parallel:
        x = x.chunk(tp)[dist.get_rank()].contiguous()

    for recompute in ("full", "selective"):
        recomputed = torch_mp.ParallelTransformerLayer.from_dense(
            layer, sequence_parallel=sequence_parallel, recompute=recompute
        )
        _no_graph_break(lambda x, m=recomputed: m(x, is_causal=True), x)
        _compiled_equals_eager(
            _Causal(kept),
            lambda y: y.square().sum(),
            x,
            seed=5,
            compiled_module=_Causal(recomputed),
        )
    checkpointed = _Checkpointed(copy.deepcopy(kept))
    _compiled_equals_eager(
        _Causal(kept), lambda y: y.square().sum(), x, seed=5, compiled_module=checkpointed
    )


def _checks_hold_compiled(tp: int) -> None:
    """Out-of-range ids and targets raise in compiled code as in eager (the operators' kernels
    see the values)."""
    use_mesh(tp)
    embedding = torch_mp.VocabParallelEmbedding(10, 8)
    compiled = torch.compile(embedding, fullgraph=True, backend="aot_eager")
    compiled(torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match=r"ids must be in \[0, 10\)"):
        compiled(torch.tensor([[1, 12]]))

    def loss(logits, target):
        return torch_mp.vocab_parallel_cross_entropy(logits, target, vocab_size=10)

    compiled_loss = torch.compile(loss, fullgraph=True, backend="aot_eager")
    logits = torch.randn(3, embedding.num_embeddings_per_partition)
    compiled_loss(logits, torch.tensor([0, 9, 4]))
    with pytest.raises(RuntimeError, match=r"target ids must be in \[0, 10\)"):
        compiled_loss(logits, torch.tensor([0, 10, 4]))


def _mlp_dropout(tp: int) -> None:
    """Dropout inside the tensor-parallel region draws from each rank's stream, compiled too."""
    use_mesh(tp)
    torch.manual_seed(6)
    mlp = torch_mp.ParallelMLP(16, 32, dropout=0.5)
    x = torch.randn(6, 16)
    _no_graph_break(mlp, x)
    _compiled_equals_eager(mlp, lambda y: y.square().sum(), x, seed=7)


def _loss(tp: int) -> None:
    use_mesh(tp)
    torch.manual_seed(2)
    vocab = 10  # padded shards at 4 ranks
    embedding = torch_mp.VocabParallelEmbedding(vocab, 8)
    target = torch.tensor([[1, 9, -100, 3], [0, 4, 7, 2]])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = embedding

        def forward(self, ids):
            logits = self.embedding(ids) @ self.embedding.weight.T  # [b, s, V_local]
            return torch_mp.vocab_parallel_cross_entropy(
                logits, target, label_smoothing=0.1, vocab_size=vocab
            )

    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 0]])
    _no_graph_break(Model(), ids)
    _compiled_equals_eager(Model(), lambda loss: loss, ids)


def _convolutions(tp: int) -> None:
    use_mesh(tp)
    torch.manual_seed(3)
    block = torch_mp.ParallelConvBlock.from_dense(dense.ConvBlock(3, 8, 4))
    x = torch.randn(2, 3, 9, 7)
    _no_graph_break(block, x)
    _compiled_equals_eager(block, lambda y: y.square().sum(), x)
    pair = nn.Sequential(
        torch_mp.ColumnParallelConv2d(3, 8, (3, 2), padding="same", padding_mode="reflect"),
        torch_mp.RowParallelConv2d(8, 4, 3, stride=2, padding=1, padding_mode="circular"),
    )
    _compiled_equals_eager(pair, lambda y: y.square().sum(), x)


@pytest.mark.parametrize("tp", [2, 4])
def test_convolutions_compile_whole_and_equal_eager(tp):
    get_world(tp).run(_convolutions, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_compiles_whole_and_equals_eager(tp):
    get_world(tp).run(_mlp, tp)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_layer_compiles_whole_and_equals_eager(tp, sequence_parallel):
    get_world(tp).run(_transformer_layer, tp, sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_loss_compiles_whole_and_equals_eager(tp):
    get_world(tp).run(_loss, tp)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_layer_with_masks_and_dropout_compiles_and_equals_eager(tp, sequence_parallel):
    get_world(tp).run(_transformer_layer_mask_and_dropout, tp, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_recomputed_transformer_layer_compiles_and_equals_eager_without_recompute(
    world2, sequence_parallel
):
    world2.run(_transformer_layer_recompute, 2, sequence_parallel)


@pytest.mark.parametrize("tp", [1, 2])
def test_mlp_dropout_compiles_and_draws_what_eager_draws(tp):
    get_world(tp).run(_mlp_dropout, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_checks_of_ids_and_targets_hold_in_compiled_code(tp):
    get_world(tp).run(_checks_hold_compiled, tp)


def test_the_package_has_one_definition_of_the_math():
    """No traceable Python copy of the layers and no branch on torch.compile in the package."""
    package = Path(torch_mp.__file__).parent
    assert not (package / "ops.py").exists()
    for source in package.rglob("*.py"):
        assert "is_compiling" not in source.read_text(), source


def _context_parallel_layer(tp: int, method: str) -> None:
    """A layer whose sequence is split over a context group of 2 (each tensor rank's heads
    through it): compiled whole, it equals eager, and the loss's mean over the context group
    compiles too."""
    use_mesh(tp, 1, 2)
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, norm_first=True)
    parallel = torch_mp.ParallelTransformerLayer.from_dense(
        layer, context_parallel=True, context_method=method
    )
    x = cp.shard_sequence(torch.randn(8, 2, 16), 0)
    _no_graph_break(lambda x: parallel(x, is_causal=True), x)
    _compiled_equals_eager(_Causal(parallel), lambda y: y.square().sum(), x)
    target = cp.shard_sequence(torch.randint(0, 16, (8, 2), generator=torch.Generator()), 0)

    def loss(logits):
        return torch_mp.vocab_parallel_cross_entropy(logits, target, context_parallel=True)

    logits = cp.shard_sequence(torch.randn(8, 2, 16), 0).chunk(tp, -1)[dist.get_rank() % tp]
    _no_graph_break(loss, logits)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(logits), loss(logits), **TOL)


@pytest.mark.parametrize("method", ["ring", "all_gather", "all_to_all"])
@pytest.mark.parametrize("tp", [1, 2])
def test_context_parallel_layer_compiles_whole_and_equals_eager(tp, method):
    get_world(2 * tp).run(_context_parallel_layer, tp, method)


def _compiled_all_gather_agrees_the_parts() -> str | None:
    """Compiled, all_gather attention without a mask (whose positions go unused) still agrees
    the ranks' parts before gathering them: rank 1's longer part raises on both ranks."""
    use_mesh(1, 1, 2)
    attend = torch.compile(
        lambda q: cp.attention(q, q, q, method="all_gather"), fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(
        attend(torch.ones(1, 2, 4, 8)), torch.ones(1, 2, 4, 8), **TOL
    )  # (compiled once with equal parts)
    return error_of(attend, torch.randn(1, 2, 4 + 2 * dist.get_rank(), 8))


def test_compiled_all_gather_attention_agrees_the_parts():
    for error in get_world(2).run(_compiled_all_gather_agrees_the_parts):
        assert error is not None and "then q's, k's and v's dims and sizes" in error
