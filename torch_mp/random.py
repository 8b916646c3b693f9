"""The RNG tracker under its public name, ``torch_mp.random``: see
:mod:`torch_mp.tensor_parallel.random` (the face of csrc/torch_mp/tensor_parallel/random.h)."""

from torch_mp.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    add,
    fork,
    manual_seed,
    region_dropout,
    reset,
)

__all__ = ["MODEL_PARALLEL_RNG", "add", "fork", "manual_seed", "region_dropout", "reset"]
