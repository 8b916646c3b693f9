"""torch_mp: model-parallel training for PyTorch over one C++ core.

Launch with ``torchrun``, then::

    import torch_mp
    mesh = torch_mp.init(tp=2)                       # tensor x data x pipeline groups
    fc1 = torch_mp.ColumnParallelLinear(1024, 4096)  # output features split over mesh.tp_group
    fc2 = torch_mp.RowParallelLinear(4096, 1024)     # input features split, output all-reduced
"""

import torch
import torch.distributed  # noqa: F401  (registers the c10d types the core uses)

from torch_mp import (
    _C,  # noqa: F401
    checkpoint,
    context_parallel,
    data_parallel,
    dense,
    functional,
    moe,
    optim,
    pipeline,
    random,
    tensor_parallel,
)
from torch_mp._C import LayoutError
from torch_mp.check_finite import check_finite
from torch_mp.data_parallel import DataParallel
from torch_mp.layout import ParameterLayout, layout_of, set_layout
from torch_mp.mesh import Mesh, get_mesh, init, set_mesh
from torch_mp.optim import DistributedOptimizer, GradScaler
from torch_mp.optim.clip_grad import clip_grad_norm_
from torch_mp.parallelize import parallelize
from torch_mp.recompute import recompute
from torch_mp.tensor_parallel import (
    ColumnParallelConv2d,
    ColumnParallelLinear,
    ParallelConvBlock,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerLayer,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelConv2d",
    "ColumnParallelLinear",
    "DataParallel",
    "DistributedOptimizer",
    "GradScaler",
    "LayoutError",
    "Mesh",
    "ParameterLayout",
    "ParallelConvBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerLayer",
    "RowParallelConv2d",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "check_finite",
    "checkpoint",
    "clip_grad_norm_",
    "context_parallel",
    "data_parallel",
    "dense",
    "functional",
    "get_mesh",
    "init",
    "layout_of",
    "moe",
    "optim",
    "parallelize",
    "pipeline",
    "random",
    "recompute",
    "set_layout",
    "set_mesh",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
