"""The fused CUDA cross-entropy kernels against the CPU path (the reference), where a GPU is
present. Every rank uses cuda:0 (Gloo moves CUDA tensors through the host). Without a GPU these
tests are skipped; the kernels are still compiled by every build whose torch has CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import rank_tensor, use_mesh

import torch_mp
from torch_mp import _C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fused_matches_cpu(vocab: int, dtype: torch.dtype, unaligned: bool) -> None:
    assert _C.has_fused_cuda_kernels(), "torch has CUDA but torch_mp was built without the kernels"
    use_mesh(dist.get_world_size())
    _, rows, real = _C.vocab_range(vocab, torch_mp.get_mesh().tp_group.group_name)
    n = 300  # more rows than some grids have blocks
    shard = rank_tensor(1, dist.get_rank(), n, rows) * 4
    shard[:, real:] = 1e4  # padding must not count
    target = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(2))
    target[::7] = -100
    results = []
    for device in ("cpu", "cuda"):
        base = torch.zeros(n * rows + 1, dtype=dtype, device=device)
        start = 1 if unaligned else 0  # a view whose rows do not start on 16 bytes
        logits = base[start : start + n * rows].view(n, rows)
        with torch.no_grad():
            logits.copy_(shard.to(dtype))
        logits.requires_grad_()
        loss = torch_mp.vocab_parallel_cross_entropy(
            logits, target.to(device), label_smoothing=0.1, vocab_size=vocab
        )
        loss.backward()
        results.append((loss.detach().float().cpu(), logits.grad.float().cpu()))
    (cpu_loss, cpu_grad), (cuda_loss, cuda_grad) = results
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(cuda_grad, cpu_grad, rtol=tolerance, atol=tolerance * 1e-2)
    assert torch.count_nonzero(cuda_grad[:, real:]) == 0


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("vocab", [13, 1001], ids=["v13", "v1001"])
def test_fused_cross_entropy_matches_the_cpu_path(world2, vocab, dtype, unaligned):
    world2.run(_fused_matches_cpu, vocab, dtype, unaligned)


def test_fused_cross_entropy_with_a_padding_only_shard(world4):
    world4.run(_fused_matches_cpu, 5, torch.float32, True)  # rank 3 holds padding only
