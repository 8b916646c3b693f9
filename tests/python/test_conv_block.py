"""ParallelConvBlock against torch_mp.dense.ConvBlock on one process, BatchNorm running
statistics included."""

from __future__ import annotations

import torch
import torch.distributed as dist
from reference import assert_close, rank_tensor, use_mesh

import torch_mp

SEQ_PER_RANK, BATCH, HIDDEN, HEADS, FFN = 2, 3, 16, 4, 32
# Transformer gradients are sums over s x b positions (and, for the replicated LayerNorm
# parameters under sequence parallelism, over the ranks' rows in another order): entries near
# zero differ by a few ulps of the summed terms, so atol 1e-5 there; rtol stays 1e-5.
GRAD_ATOL = 1e-5


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
