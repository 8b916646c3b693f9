"""Peak tensor memory of a piece of code, on any device (the CPU included).

``torch.cuda.max_memory_allocated`` has no CPU counterpart, so this counts allocations at the
dispatcher: every operator output (including those made inside the C++ core, whose ATen calls
pass through the same dispatcher) whose storage is new counts while the storage lives. Storages
that existed before (inputs, parameters) and in-place results are not counted again. Used by
the cross-entropy memory benchmark and its test.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """Context manager: ``peak`` (bytes) is the most tensor storage allocated inside it and alive
    at once; ``current`` what is still alive. Storages made before it are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._live: dict[int, tuple[int, StorageWeakRef]] = {}  # address -> (bytes, weak ref)

    @property
    def current(self) -> int:
        self._sweep()
        return sum(nbytes for nbytes, _ in self._live.values())

    def _sweep(self) -> None:
        for key in [k for k, (_, ref) in self._live.items() if ref.expired()]:
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs, _ = tree_flatten((args, kwargs))
        seen = {_address(t) for t in inputs if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        self._sweep()
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = _address(t)
                if key not in seen and key not in self._live and storage.nbytes() > 0:
                    self._live[key] = (storage.nbytes(), StorageWeakRef(storage))
        self.peak = max(self.peak, sum(nbytes for nbytes, _ in self._live.values()))
        return out


def _address(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage lies; None for a storage without data (one resized to nothing, as
    FSDP leaves its unsharded parameters between uses)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None
