"""ColumnParallelConv2d and RowParallelConv2d against the dense nn.Conv2d on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn

import torch_mp

C_IN, C_MID, C_OUT = 3, 8, 5
# Parameter gradients of a convolution are sums over every output position (2 x 11 x 10 here);
# the dense kernel and ours (bias added after the all-reduce) sum them in different orders, so
# entries near zero differ by ~n ulps of the terms: atol 1e-5 for those (rtol stays 1e-5).
PARAM_ATOL = 1e-5

# (stride, padding, dilation, padding_mode): the grid both layers are held to.
GEOMETRIES = [
    (1, 0, 1, "zeros"),
    (1, 1, 1, "zeros"),
    (2, 1, 1, "zeros"),
    (1, 2, 2, "zeros"),
    ((2, 1), (1, 0), (1, 2), "zeros"),
    (1, "same", 1, "zeros"),
    (1, "same", 2, "reflect"),
    (1, "valid", 1, "zeros"),
    (1, 1, 1, "reflect"),
    (2, 1, 1, "replicate"),
    (1, (2, 1), 1, "circular"),
]


def _conv_pair_matches_dense(stride, padding, dilation, mode, kernel, gather, unbatched) -> None:
    """Column(in -> mid) -> ReLU -> Row(mid -> out) from dense layers equals the dense pair:
    output, input gradient, and each weight/bias gradient against the dense chunk."""
    mesh = use_mesh(dist.get_world_size())
    t, r = mesh.tp_size, mesh.tp_rank
    geometry = {"stride": stride, "padding": padding, "dilation": dilation, "padding_mode": mode}
    torch.manual_seed(0)
    conv1 = nn.Conv2d(C_IN, C_MID, kernel, **geometry)
    conv2 = nn.Conv2d(C_MID, C_OUT, kernel, **geometry)
    shape = (C_IN, 11, 10) if unbatched else (2, C_IN, 11, 10)
    x = rank_tensor(1, 0, *shape)
    x_ref = x.clone().requires_grad_()
    y_ref = conv2(torch.relu(conv1(x_ref)))
    g = rank_tensor(2, 0, *y_ref.shape)
    y_ref.backward(g)

    col = torch_mp.ColumnParallelConv2d.from_dense(conv1, gather_output=gather)
    row = torch_mp.RowParallelConv2d.from_dense(conv2, input_is_parallel=not gather)
    x_par = x.clone().requires_grad_()
    y = row(torch.relu(col(x_par)))
    y.backward(g)

    assert_close(y, y_ref, "output")
    assert_close(x_par.grad, x_ref.grad, "input gradient")
    assert_close(
        col.weight.grad, conv1.weight.grad.chunk(t, 0)[r], "column weight gradient", PARAM_ATOL
    )
    assert_close(col.bias.grad, conv1.bias.grad.chunk(t, 0)[r], "column bias gradient", PARAM_ATOL)
    assert_close(
        row.weight.grad, conv2.weight.grad.chunk(t, 1)[r], "row weight gradient", PARAM_ATOL
    )
    assert_close(row.bias.grad, conv2.bias.grad, "row bias gradient", PARAM_ATOL)


@pytest.mark.parametrize(
    "stride,padding,dilation,mode", GEOMETRIES, ids=lambda v: str(v).replace(" ", "")
)
def test_conv_pair_matches_dense_over_the_geometry_grid(world, stride, padding, dilation, mode):
    world.run(_conv_pair_matches_dense, stride, padding, dilation, mode, 3, False, False)


@pytest.mark.parametrize("kernel", [1, (2, 3)], ids=["k1", "k2x3"])
def test_conv_pair_other_kernels_gathered_and_unbatched(world, kernel):
    world.run(_conv_pair_matches_dense, 1, 1, 1, "zeros", kernel, True, False)
    world.run(_conv_pair_matches_dense, 1, 0, 1, "zeros", kernel, False, True)


def _round_trip_and_seeded_init() -> None:
    use_mesh(dist.get_world_size())
    for cls in (torch_mp.ColumnParallelConv2d, torch_mp.RowParallelConv2d):
        torch.manual_seed(4)
        dense = nn.Conv2d(4, 8, 3, stride=2, padding="valid", padding_mode="reflect")
        back = cls.from_dense(dense).to_dense()
        assert isinstance(back, nn.Conv2d) and back.padding_mode == "reflect"
        assert torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)
        # Default init: the shard of the nn.Conv2d the same seed gives.
        torch.manual_seed(4)
        layer = cls(4, 8, 3, stride=2)
        after = torch.rand(2)
        torch.manual_seed(4)
        seeded = nn.Conv2d(4, 8, 3, stride=2)
        assert torch.equal(after, torch.rand(2)), "init drew as much as nn.Conv2d"
        gathered = layer.to_dense()
        assert torch.equal(gathered.weight, seeded.weight), cls.__name__
        assert torch.equal(gathered.bias, seeded.bias), cls.__name__


def test_to_dense_and_default_init_equal_nn_conv2d(world):
    world.run(_round_trip_and_seeded_init)


def _bad_conv_arguments() -> list[str | None]:
    use_mesh(dist.get_world_size())
    return [
        error_of(torch_mp.ColumnParallelConv2d, 3, 6, 3),
        error_of(torch_mp.RowParallelConv2d, 6, 3, 3),
        error_of(torch_mp.ColumnParallelConv2d, 4, 8, 3, groups=2),
        error_of(torch_mp.ColumnParallelConv2d, 4, 8, 3, stride=2, padding="same"),
        error_of(torch_mp.ColumnParallelConv2d, 4, 8, 3, padding_mode="mirror"),
        error_of(torch_mp.ColumnParallelConv2d, 4, 8 * (dist.get_rank() + 1), 3),
        error_of(torch_mp.ColumnParallelConv2d, 4, 8, 3, padding=-1),
    ]


def test_bad_arguments_raise_clearly(world4):
    for out_ch, in_ch, groups, same, mode, differ, negative in world4.run(_bad_conv_arguments):
        assert "padding non-negative" in negative
        assert "out_channels (6) must be divisible by the tensor-parallel size (4)" in out_ch
        assert "in_channels (6) must be divisible by the tensor-parallel size (4)" in in_ch
        assert "only groups=1" in groups
        assert "padding='same' is not supported for strided" in same
        assert "padding_mode must be" in mode
        assert "must be the same on every rank" in differ
