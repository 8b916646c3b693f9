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
    at once; ``current`` what is still alive. Storages made before it are not counted. A storage
    counts at its size of the moment: one resized to nothing (as ZeRO-3 and FSDP free their
    gathered parameters between uses) counts nothing until it is given memory again.
    ``operators`` counts the operators dispatched inside it (aten's and the libraries')."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.operators = 0
        self._live: dict[int, StorageWeakRef] = {}  # the storage (its C++ object) -> a weak ref

    @property
    def current(self) -> int:
        total = 0
        for key, ref in list(self._live.items()):
            if ref.expired():
                del self._live[key]
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += func.namespace != "prim"  # (not prim.device and the like)
        inputs, _ = tree_flatten((args, kwargs))
        seen = {_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = _key(t)
                if key is not None and key not in seen and key not in self._live:
                    self._live[key] = StorageWeakRef(t.untyped_storage())
        self.peak = max(self.peak, self.current)
        return out


def _key(t: torch.Tensor) -> int | None:
    """``t``'s storage (the address of its C++ object, which views share); None for a tensor
    without one."""
    try:
        return t.untyped_storage()._cdata
    except RuntimeError:
        return None
