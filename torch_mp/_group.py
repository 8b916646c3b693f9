"""What every torch_mp module that holds a process group shares."""

from __future__ import annotations

import copy


class SharesGroup:
    """Mixin for modules with a ``group`` attribute: ``copy.deepcopy`` shares the group (a
    communicator, not state; c10d groups cannot be copied) and copies everything else."""

    def __deepcopy__(self, memo):
        memo[id(self.group)] = self.group
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone
