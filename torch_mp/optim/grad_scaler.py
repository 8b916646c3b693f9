"""Dynamic loss scaling for fp16 training over the mesh (the C++ core's
csrc/torch_mp/optim/grad_scaler.h): ``torch.amp.GradScaler``'s interface and algorithm, with the
overflow check agreed by every rank of the model, so that an inf or NaN in one tensor shard, one
pipeline stage or one data rank's gradient pieces skips the step everywhere, as it would on one
process::

    scaler = torch_mp.GradScaler()
    for x, y in batches:
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.unscale_(optimizer)               # before clipping, if clipping
        torch_mp.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                   # skipped on every rank if any rank overflowed
        scaler.update()

With a pipeline, the loss function scales what it returns:
``Pipeline(..., loss_fn=lambda out, target: scaler.scale(loss(out, target)))``.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_mp import _C
from torch_mp.mesh import Mesh, get_mesh

__all__ = ["GradScaler"]


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class GradScaler:
    """Dynamic loss scaling agreed over the mesh (see the module's docstring).

    The gradients it unscales and checks are those an optimizer over the parameters steps from:
    each parameter's ``.grad``, or this rank's pieces of those a
    ``DataParallel(shard_gradients=True)`` (or ``grad_dtype=``) holds. So it works with plain
    optimizers and with :class:`torch_mp.DistributedOptimizer`, ZeRO-1 and ZeRO-2.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: As in
            ``torch.amp.GradScaler``: the scale starts at ``init_scale``, is multiplied by
            ``backoff_factor`` after a skipped step and by ``growth_factor`` after
            ``growth_interval`` steps in a row without one. The same on every rank (checked:
            ranks scaling by different factors would sum gradients of different scales).
        mesh: Whose tensor, pipeline and data groups agree on overflows; the default mesh when
            None.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        mesh: Mesh | None = None,
    ) -> None:
        mesh = mesh if mesh is not None else get_mesh()
        self._enabled = enabled
        self._core = _C.optim.GradScaler(
            float(init_scale),
            float(growth_factor),
            float(backoff_factor),
            int(growth_interval),
            enabled,
            mesh.tp_group.group_name,
            mesh.pp_group.group_name,
            mesh.dp_cp_group.group_name,
        )

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list or tuple of them) times the scale."""
        if isinstance(outputs, torch.Tensor):
            return self._core.scale(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"GradScaler.scale: expected tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients of ``optimizer``'s parameters by the scale and checks them for
        inf and NaN on every rank (a collective over the mesh). At most once per step (a
        second call raises)."""
        self._core.unscale_(_parameters(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (unless :meth:`unscale_` ran this step), then ``optimizer.step(*args,
        **kwargs)`` unless some rank's gradients overflowed. Returns what the step returned,
        or None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if not self._core.unscaled:
            self.unscale_(optimizer)
        if self._core.found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Backs the scale off after a skipped step, grows it after ``growth_interval`` clean
        ones, or sets it to ``new_scale``; readies the next step."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._core.load(float(new_scale), self._core.growth_tracker)
        else:
            self._core.update()

    def found_inf(self) -> bool:
        """Whether this step's gradients overflowed on some rank (after unscaling)."""
        return self._core.found_inf

    def get_scale(self) -> float:
        return self._core.get_scale()

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """The scale and growth tracker (``torch.amp.GradScaler``'s keys), for checkpoints."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "_growth_tracker": self._core.growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        self._core.load(float(state_dict["scale"]), int(state_dict["_growth_tracker"]))
