"""What every torch_mp module that holds a process group shares."""

from __future__ import annotations

import copy

import torch.distributed as dist


class SharesGroup:
    """Mixin for modules that hold process groups (a ``group``, a ``context_group``...).

    - ``copy.deepcopy`` shares the groups (communicators, not state; c10d groups cannot be
      copied) and copies everything else.
    - Parameter layouts (:func:`torch_mp.layout_of`) follow the parameters: a module records
      the layouts of its own parameters in :meth:`_register_layouts`, which runs again whenever
      they may have been replaced (``to``/``to_empty``/``cuda``, ``load_state_dict(assign=True)``,
      deepcopy).
    """

    def _register_layouts(self) -> None:
        """Records how this module's own parameters lie on the mesh; none by default."""

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self._register_layouts()
        return result

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._register_layouts()

    def __deepcopy__(self, memo):
        for value in self.__dict__.values():
            if isinstance(value, dist.ProcessGroup):
                memo[id(value)] = value
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        clone._register_layouts()
        return clone
