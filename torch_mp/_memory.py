"""Peak tensor memory of a piece of code, on any device (the CPU included).

``torch.cuda.max_memory_allocated`` has no CPU counterpart, so this counts allocations at the
dispatcher: every operator output (including those made inside the C++ core, whose ATen calls
pass through the same dispatcher) whose storage is new counts while the storage lives. Storages
that existed before (inputs, parameters) and in-place results are not counted again. The table
of storages is the core's (``csrc/torch_mp/live_storages.h``). Used by the planner's
measurements and traces, the cross-entropy memory benchmark and its test.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch_mp import _C


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
        self._live = _C.LiveStorages()  # the storages counted, by weak reference

    @property
    def current(self) -> int:
        return self._live.bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += func.namespace != "prim"  # (not prim.device and the like)
        out = func(*args, **(kwargs or {}))
        inputs, _ = tree_flatten((args, kwargs))
        outputs, _ = tree_flatten(out)
        made = [t for t in outputs if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        given = [t for t in inputs if isinstance(t, torch.Tensor)] if made else []
        self.peak = max(self.peak, self._live.add(given, made))
        return out
