"""VocabParallelEmbedding and vocab_parallel_cross_entropy against nn.Embedding and
F.cross_entropy on one process, with vocabularies the group size does and does not divide."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn
from torch.nn import functional as F

import torch_mp
from torch_mp import _C

DIM = 6


def _my_rows(full: torch.Tensor, vocab: int, fill: float = 0.0) -> torch.Tensor:
    """This rank's rows [start, start + rows) of ``full`` (dim 0), padded past ``vocab`` with
    ``fill``."""
    start, rows, real = _C.vocab_range(vocab, torch_mp.get_mesh().tp_group.group_name)
    out = full.new_full((rows, *full.shape[1:]), fill)
    out[:real] = full[start : start + real]
    return out


def _embedding_matches_dense(vocab: int, padding_idx: int | None) -> None:
    use_mesh(dist.get_world_size())
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, DIM, padding_idx=padding_idx)
    ids = torch.randint(0, vocab, (4, 7))
    ids[0, :3] = torch.tensor([0, vocab - 1, 1 if padding_idx is None else padding_idx % vocab])
    g = rank_tensor(1, 0, 4, 7, DIM)
    dense(ids).backward(g)

    layer = torch_mp.VocabParallelEmbedding.from_dense(dense)
    y = layer(ids)
    y.backward(g)
    assert_close(y, dense(ids), "output")
    assert_close(layer.weight.grad, _my_rows(dense.weight.grad, vocab), "weight gradient rows")
    assert torch.equal(layer.to_dense().weight, dense.weight)


@pytest.mark.parametrize("vocab", [16, 13, 5], ids=["v16", "v13", "v5"])
@pytest.mark.parametrize("padding_idx", [None, 2, -1], ids=["nopad", "pad2", "pad-1"])
def test_embedding_matches_dense(world, vocab, padding_idx):
    world.run(_embedding_matches_dense, vocab, padding_idx)


def _embedding_init_and_errors() -> list[str | None]:
    use_mesh(dist.get_world_size())
    torch.manual_seed(3)
    layer = torch_mp.VocabParallelEmbedding(13, DIM, padding_idx=4)
    after = torch.rand(2)
    torch.manual_seed(3)
    seeded = nn.Embedding(13, DIM, padding_idx=4)
    assert torch.equal(after, torch.rand(2))
    assert torch.equal(layer.to_dense().weight, seeded.weight)
    start, rows = layer.vocab_start_index, layer.num_embeddings_per_partition
    assert rows == -(-13 // dist.get_world_size()) and start == dist.get_rank() * rows
    return [
        error_of(layer, torch.tensor([0, 13])),
        error_of(layer, torch.tensor([-1])),
        error_of(torch_mp.VocabParallelEmbedding, 13, DIM, padding_idx=13),
        error_of(torch_mp.VocabParallelEmbedding, 10 + dist.get_rank(), DIM),
    ]


def test_embedding_default_init_and_errors(world2):
    for high, low, padding, differ in world2.run(_embedding_init_and_errors):
        assert "ids must be in [0, 13), got ids in [0, 13]" in high
        assert "got ids in [-1, -1]" in low
        assert "padding_idx (13) must be within num_embeddings (13)" in padding
        assert "must be the same on every rank" in differ


def _cross_entropy_matches_dense(vocab, smoothing, reduction, ignore, ignore_index=-100) -> None:
    """Logits [5, 3, V]; each rank holds its columns, padded with huge values that must be
    ignored. Loss and the logits gradient."""
    use_mesh(dist.get_world_size())
    full = rank_tensor(1, 0, 5, 3, vocab) * 3
    target = torch.randint(0, vocab, (5, 3), generator=torch.Generator().manual_seed(2))
    if ignore:
        target[0, 1] = target[3, 0] = ignore_index
        target[4, 2] = vocab - 1
    full_ref = full.clone().requires_grad_()
    kwargs = {"ignore_index": ignore_index, "label_smoothing": smoothing, "reduction": reduction}
    loss_ref = F.cross_entropy(full_ref.view(-1, vocab), target.view(-1), **kwargs)
    if reduction == "none":
        loss_ref = loss_ref.view(5, 3)
    g = rank_tensor(2, 0, *loss_ref.shape) if loss_ref.dim() else torch.tensor(1.7)
    loss_ref.backward(g)

    mine = _my_rows(full.movedim(-1, 0), vocab, 1e4).movedim(0, -1).contiguous().requires_grad_()
    loss = torch_mp.vocab_parallel_cross_entropy(mine, target, vocab_size=vocab, **kwargs)
    loss.backward(g)
    assert_close(loss, loss_ref.detach(), "loss")
    expected_grad = _my_rows(full_ref.grad.movedim(-1, 0), vocab).movedim(0, -1)
    assert_close(mine.grad, expected_grad, "logits gradient")
    _, rows, real = _C.vocab_range(vocab, torch_mp.get_mesh().tp_group.group_name)
    assert torch.count_nonzero(mine.grad[..., real:]) == 0, "padded entries got gradient"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["ls0", "ls0.1"])
@pytest.mark.parametrize("vocab", [16, 13], ids=["v16", "v13"])
def test_cross_entropy_matches_dense(world, vocab, smoothing, reduction):
    world.run(_cross_entropy_matches_dense, vocab, smoothing, reduction, True)


def test_cross_entropy_without_ignored_targets_tiny_vocab_and_ignore_index_in_vocab(world4):
    world4.run(_cross_entropy_matches_dense, 16, 0.0, "mean", False)
    world4.run(_cross_entropy_matches_dense, 5, 0.2, "mean", True)  # rank 3 holds padding only
    world4.run(_cross_entropy_matches_dense, 13, 0.1, "mean", True, 0)  # class 0 ignored


def _cross_entropy_low_precision(dtype: torch.dtype) -> None:
    """70000 fp16/bf16 rows: the mean is taken in float (an fp16 sum or count would overflow),
    matching F.cross_entropy on the same values in float."""
    use_mesh(dist.get_world_size())
    rows, vocab = 70000, 8
    full = (rank_tensor(3, 0, rows, vocab) * 2).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(4))
    expected = F.cross_entropy(full.float(), target)
    mine = full.chunk(dist.get_world_size(), -1)[dist.get_rank()].contiguous()
    loss = torch_mp.vocab_parallel_cross_entropy(mine, target)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss.float(), expected, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cross_entropy_low_precision_mean_over_many_rows(world2, dtype):
    world2.run(_cross_entropy_low_precision, dtype)


def _embedding_to_tied_head_to_loss() -> None:
    """GPT-style: a padded vocabulary embedding, its table reused as the output head (logits on
    the padded shard), the loss with vocab_size: equals the dense model end to end."""
    use_mesh(dist.get_world_size())
    vocab = 13
    torch.manual_seed(1)
    dense = nn.Embedding(vocab, DIM)
    ids = torch.randint(0, vocab, (4, 5))
    target = torch.randint(0, vocab, (4, 5))
    h_ref = torch.tanh(dense(ids))
    F.cross_entropy((h_ref @ dense.weight.t()).view(-1, vocab), target.view(-1)).backward()

    emb = torch_mp.VocabParallelEmbedding.from_dense(dense)
    h = torch.tanh(emb(ids))
    logits = torch_mp.functional.copy_to_tp(h) @ emb.weight.t()
    torch_mp.vocab_parallel_cross_entropy(logits, target, vocab_size=vocab).backward()
    assert_close(emb.weight.grad, _my_rows(dense.weight.grad, vocab), "tied weight gradient")


def test_tied_embedding_and_output_head_match_dense(world):
    world.run(_embedding_to_tied_head_to_loss)


def _cross_entropy_errors() -> list[str | None]:
    use_mesh(dist.get_world_size())
    t = dist.get_world_size()
    logits = torch.zeros(4, 8 // t, requires_grad=True)
    ce = torch_mp.vocab_parallel_cross_entropy
    loss = ce(logits, torch.tensor([0, 1, 2, 3]))
    loss.backward(retain_graph=True)
    return [
        error_of(ce, logits, torch.tensor([0, 8, 1, 1])),
        error_of(ce, logits, torch.tensor([0, 1])),
        error_of(ce, logits, torch.tensor([0, 1, 2, 3]), reduction="avg"),
        error_of(ce, logits, torch.tensor([0, 1, 2, 3]), vocab_size=3),
        error_of(loss.backward),
    ]


def _cross_entropy_in_double() -> None:
    """Double logits are computed in double: tight agreement with F.cross_entropy."""
    use_mesh(dist.get_world_size())
    t, r = dist.get_world_size(), dist.get_rank()
    full = rank_tensor(5, 0, 6, 16).double() * 3
    target = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(6))
    full_ref = full.clone().requires_grad_()
    expected = F.cross_entropy(full_ref, target, label_smoothing=0.1)
    expected.backward()
    mine = full.chunk(t, -1)[r].clone().requires_grad_()
    loss = torch_mp.vocab_parallel_cross_entropy(mine, target, label_smoothing=0.1)
    loss.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine.grad, full_ref.grad.chunk(t, -1)[r], rtol=1e-12, atol=1e-14)

    def second_derivative():
        loss = torch_mp.vocab_parallel_cross_entropy(mine, target)
        (grad,) = torch.autograd.grad(loss, mine, create_graph=True)
        grad.sum().backward()

    message = error_of(second_derivative)
    assert message is not None and "not twice differentiable" in message, message


def test_cross_entropy_in_double_and_no_double_backward(world):
    world.run(_cross_entropy_in_double)


def _cross_entropy_bad_input_on_one_rank() -> list[str | None]:
    use_mesh(dist.get_world_size())
    r = dist.get_rank()
    logits = torch.zeros(4, 4)
    ce = torch_mp.vocab_parallel_cross_entropy
    bad_target = torch.tensor([0, 1, 2, 99 if r == 1 else 3])
    return [
        error_of(ce, logits, bad_target),
        error_of(ce, logits, torch.tensor([0, 1, 2, 3]), vocab_size=7 + r % 2),
        error_of(ce, logits, torch.tensor([0, 1, 2, 3]), label_smoothing=0.1 * r),
        error_of(ce, logits, torch.tensor([0, 1, 2, 3]), reduction="mean" if r else "avg"),
        error_of(ce, logits, torch.tensor([0, 1, 2, 3]), label_smoothing=2.0 if r else 0.0),
    ]


def test_cross_entropy_input_bad_on_one_rank_raises_on_every_rank(world2):
    first, second = world2.run(_cross_entropy_bad_input_on_one_rank)
    ids0, vocab0, smooth0, reduction0, range0 = first
    ids1, vocab1, smooth1, reduction1, range1 = second
    assert "target ids must be in [0, 8)" in ids1
    assert "reduction must be 'none', 'mean' or 'sum', got 'avg'" in reduction0
    assert "label_smoothing must be in [0, 1], got 2" in range1
    for message in (ids0, reduction1, range0):
        assert "another rank of the group was given invalid input" in message
    for message in (vocab0, vocab1, smooth0, smooth1):
        assert "must be the same on every rank of the group" in message


def test_cross_entropy_errors(world2):
    for out_of_range, shape, reduction, vocab, twice in world2.run(_cross_entropy_errors):
        assert "target ids must be in [0, 8) or ignore_index (-100), got ids in [0, 8]" in (
            out_of_range
        )
        assert "target must have the logits' shape" in shape
        assert "reduction must be 'none', 'mean' or 'sum'" in reduction
        assert "does not fit a vocabulary of 3" in vocab
        assert "backward ran twice" in twice


def _cross_entropy_peak_memory() -> tuple[int, int]:
    """Forward + backward allocate one shard-sized buffer (the softmax numerators, turned into
    the gradient in place) plus O(rows) bookkeeping: never the gathered logits."""
    from torch_mp._memory import PeakMemory

    use_mesh(dist.get_world_size())
    rows_n, vocab = 256, 1001
    _, rows, _ = _C.vocab_range(vocab, torch_mp.get_mesh().tp_group.group_name)
    logits = torch.randn(rows_n, rows, requires_grad=True)
    target = torch.randint(0, vocab, (rows_n,))
    with PeakMemory() as memory:
        torch_mp.vocab_parallel_cross_entropy(logits, target, vocab_size=vocab).backward()
    shard_bytes = rows_n * rows * 4
    assert memory.peak <= shard_bytes + 64 * rows_n * 4, (memory.peak, shard_bytes)
    with PeakMemory() as dense_memory:  # for scale: the one-process loss on all the logits
        F.cross_entropy(torch.randn(rows_n, vocab, requires_grad=True), target).backward()
    return memory.peak, dense_memory.peak


def test_cross_entropy_peak_memory_is_one_shard(world):
    peaks = world.run(_cross_entropy_peak_memory)
    t = len(peaks)
    for parallel, dense in peaks:
        assert parallel < dense / (2 * t), (parallel, dense)
