"""The autograd-aware collectives under their public name, ``torch_mp.functional``: see
:mod:`torch_mp.collectives` (the face of the core's csrc/torch_mp/collectives.h)."""

from torch_mp.collectives import (
    check_collectives,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
    set_check_collectives,
)

__all__ = [
    "check_collectives",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_tp",
    "set_check_collectives",
]
