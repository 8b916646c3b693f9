"""The channel-parallel convolutional block and the BatchNorm over a rank's channels (the C++
core's csrc/torch_mp/tensor_parallel/conv_block.h). The block's forward is three calls: the
channel-parallel convolutions' operators and torch's BatchNorm on this rank's channels."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.dense import ConvBlock
from torch_mp.mesh import tp_group_or_default
from torch_mp.tensor_parallel._shell import empty_like_dense, materialise
from torch_mp.tensor_parallel.conv import ColumnParallelConv2d, RowParallelConv2d


class ChannelParallelBatchNorm2d(SharesGroup, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` over this rank's channels: between a column- and a row-parallel
    convolution, each rank normalises the channels it holds (their statistics need no
    communication). Parameters and running statistics are recorded as sharded along dim 0.

    Args:
        num_features: This rank's channels (the dense norm's divided by the group size).
        group: The tensor-parallel group; the default mesh's when None.
        **kwargs: As for ``nn.BatchNorm2d``.
    """

    def __init__(self, num_features: int, group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.group = tp_group_or_default(group)
        self._register_layouts()

    def _register_layouts(self) -> None:
        for tensor in (self.weight, self.bias, self.running_mean, self.running_var):
            if tensor is not None:
                _C.set_layout(tensor, 0, self.group.group_name)

    @classmethod
    def from_dense(
        cls, norm: nn.BatchNorm2d, group: dist.ProcessGroup | None = None
    ) -> ChannelParallelBatchNorm2d:
        """This rank's channels of ``norm`` (device and dtype kept)."""
        group = tp_group_or_default(group)
        t = dist.get_world_size(group)
        if norm.num_features % t:
            raise ValueError(
                f"ChannelParallelBatchNorm2d: num_features ({norm.num_features}) must be "
                f"divisible by the tensor-parallel size ({t})"
            )
        layer = cls(
            norm.num_features // t,
            group,
            eps=norm.eps,
            momentum=norm.momentum,
            affine=norm.affine,
            track_running_stats=norm.track_running_stats,
            device="meta",
        )
        empty_like_dense(norm, layer)
        layer.load_dense(norm)
        return layer

    def load_dense(self, norm: nn.BatchNorm2d) -> None:
        """Copies this rank's channels of ``norm``: parameters and running statistics."""
        with torch.no_grad():
            for key in ("weight", "bias", "running_mean", "running_var"):
                if getattr(self, key) is not None:
                    getattr(self, key).copy_(_C.shard(getattr(norm, key), 0, self.group.group_name))
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.copy_(norm.num_batches_tracked)

    def to_dense(self) -> nn.BatchNorm2d:
        """The dense ``nn.BatchNorm2d`` on every rank (a collective over the group)."""
        t = dist.get_world_size(self.group)
        floats = [x for x in (*self.parameters(), *self.buffers()) if x.is_floating_point()]
        dense = nn.BatchNorm2d(
            self.num_features * t,
            eps=self.eps,
            momentum=self.momentum,
            affine=self.affine,
            track_running_stats=self.track_running_stats,
        )
        if floats:
            dense.to(device=floats[0].device, dtype=floats[0].dtype)
        with torch.no_grad():
            for key in ("weight", "bias", "running_mean", "running_var"):
                local = getattr(self, key)
                if local is not None:
                    gathered = _C.unshard(local.detach(), 0, self.group.group_name)
                    getattr(dense, key).copy_(gathered)
            if self.num_batches_tracked is not None:
                dense.num_batches_tracked.copy_(self.num_batches_tracked)
        return dense


class ParallelConvBlock(DeclaredOptions, SharesGroup, nn.Module, declared="ParallelConvBlock"):
    """``conv2(relu(norm(conv1(x))))`` with the middle channels split across the group.

    ``conv1`` is a :class:`ColumnParallelConv2d` (in -> mid), ``norm`` a ``BatchNorm2d`` over this
    rank's ``mid / t`` channels (BatchNorm acts per channel, so its shard is exact, running
    statistics included), ``conv2`` a :class:`RowParallelConv2d` (mid -> out): one all-reduce
    forward, one backward. Equals :class:`torch_mp.dense.ConvBlock`.

    Args (the options the C++ core declares, csrc/torch_mp/tensor_parallel/conv_block.h):
        in_channels, mid_channels, out_channels: The channels in, in the middle (divisible by
            the group size) and out.
        kernel_size: Of both convolutions.
        padding: Of both convolutions; ``kernel_size // 2`` when None.
        bias: Biases on both convolutions.
        group: The tensor-parallel group; the default mesh's when None.
        device, dtype: Where and in what type to create the parameters.

    Raises:
        RuntimeError: If ``mid_channels`` is not divisible by the group size.
    """

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(args, kwargs, group=tp_group_or_default)
        self._check_options(o)
        children = self._children(conv1=ColumnParallelConv2d, conv2=RowParallelConv2d)
        self.conv1 = ColumnParallelConv2d(**children["conv1"], device="meta")
        self.norm = ChannelParallelBatchNorm2d(
            self.mid_channels // dist.get_world_size(self.group), self.group, device="meta"
        )
        self.conv2 = RowParallelConv2d(**children["conv2"], device="meta")
        materialise(self, device, dtype)

    def reset_parameters(self) -> None:
        """Draws conv1 then conv2 as ``nn.Conv2d`` layers would be drawn."""
        self.conv1.reset_parameters()
        self.norm.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.norm(self.conv1(x))))

    @classmethod
    def from_dense(cls, block: ConvBlock, *args, **kwargs) -> ParallelConvBlock:
        """Shards a :class:`torch_mp.dense.ConvBlock` (device and dtype kept, no random draws);
        ``group`` as the constructor's."""
        taken = {
            "in_channels": block.conv1.in_channels,
            "mid_channels": block.conv1.out_channels,
            "out_channels": block.conv2.out_channels,
            "kernel_size": block.conv1.kernel_size[0],
            "padding": block.conv1.padding[0],
            "bias": block.conv1.bias is not None,
        }
        parallel = cls._from_dense(block, args, kwargs, taken)
        parallel.norm.eps, parallel.norm.momentum = block.norm.eps, block.norm.momentum
        empty_like_dense(block, parallel)
        parallel.load_dense(block)
        return parallel

    def load_dense(self, block: ConvBlock) -> None:
        """Copies this rank's channels of ``block`` (convolutions, BatchNorm parameters and
        running statistics) into this block."""
        name = self.group.group_name
        for mine, dense, dim in ((self.conv1, block.conv1, 0), (self.conv2, block.conv2, 1)):
            _C.load_dense_linear_(mine.weight, mine.bias, dense.weight, dense.bias, dim, name)
        self.norm.load_dense(block.norm)

    def to_dense(self) -> ConvBlock:
        """Gathers the block into a :class:`torch_mp.dense.ConvBlock` on every rank (a
        collective), BatchNorm running statistics included."""
        conv1 = self.conv1.to_dense()
        block = ConvBlock(
            conv1.in_channels,
            conv1.out_channels,
            self.conv2.out_channels,
            conv1.kernel_size[0],
            conv1.padding[0],
            conv1.bias is not None,
        )
        block.conv1, block.norm, block.conv2 = conv1, self.norm.to_dense(), self.conv2.to_dense()
        return block
