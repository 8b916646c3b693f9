"""A model of any layout to and from one plain state dict in memory, keyed as the dense model's
``state_dict`` is (the file form of it is :func:`torch_mp.checkpoint.export_dense`).

A tensor-parallel module knows its dense counterpart: ``to_dense()`` gathers it (a collective
over its group) and ``load_dense(dense)`` copies this rank's part back. Every other module's
parameters and buffers are taken as they are (they are whole on every rank). Pipeline stages
name their parameters as the stage does; ``rename`` maps those names to the dense model's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp.data_parallel import whole_parameters
from torch_mp.layout import layout_of, refuse_dtensors

Rename = Callable[[str], "str | None"] | Mapping[str, str] | None


def _is_parallel(module: nn.Module) -> bool:
    return callable(getattr(module, "to_dense", None)) and callable(
        getattr(module, "load_dense", None)
    )


def _renamer(rename: Rename) -> Callable[[str], str | None]:
    """A callable from a callable, a mapping of name prefixes (longest first), or None."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    prefixes = sorted(rename.items(), key=lambda item: -len(item[0]))

    def by_prefix(name: str) -> str | None:
        for old, new in prefixes:
            if name.startswith(old):
                return None if new is None else new + name[len(old) :]
        return name

    return by_prefix


@dataclass
class _Part:
    """A module whose tensors are loaded together: a tensor-parallel one through its dense
    twin, or a plain one's own parameters and buffers."""

    module: nn.Module
    prefix: str
    twin: nn.Module | None  # the dense counterpart (tensor-parallel modules)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Dense-named tensors, relative to the prefix."""
        if self.twin is not None:
            return dict(self.twin.state_dict(keep_vars=True))
        own = dict(self.module.named_parameters(recurse=False))
        for name, buffer in self.module.named_buffers(recurse=False):
            if name not in self.module._non_persistent_buffers_set and buffer is not None:
                own[name] = buffer
        return own


def _parts(module: nn.Module, prefix: str = "") -> list[_Part]:
    """Walks ``module``; gathers every tensor-parallel module's dense twin (a collective, in the
    same order on every rank of its group)."""
    if _is_parallel(module):
        return [_Part(module, prefix, module.to_dense())]
    part = _Part(module, prefix, None)
    for name, tensor in part.tensors().items():
        layout = layout_of(tensor) if isinstance(tensor, nn.Parameter) else None
        if layout is not None and layout.shard_dim is not None:
            raise RuntimeError(
                f"torch_mp.checkpoint: {prefix}{name} of {type(module).__name__} is sharded "
                f"along dim {layout.shard_dim}, and its module has no dense form (to_dense / "
                "load_dense)"
            )
    parts = [part]
    for name, child in module.named_children():
        parts += _parts(child, f"{prefix}{name}.")
    return parts


def dense_state_dict(module: nn.Module, rename: Rename = None) -> dict[str, torch.Tensor]:
    """``module``'s tensors as its dense counterpart holds them: tensor-parallel modules
    gathered (a collective over each one's group), names mapped by ``rename`` (a callable
    returning the dense name or None to leave a tensor out, or a mapping of name prefixes).

    Returns:
        Detached tensors (gathered ones are fresh; others are the module's own).
    """
    refuse_dtensors(module, "torch_mp.checkpoint.dense_state_dict")
    to_dense_name = _renamer(rename)
    _C.optim.wait_for_gathers(list(module.parameters()))  # (an overlapped step's all-gather)
    out: dict[str, torch.Tensor] = {}
    with whole_parameters(module) as gathered:  # (ZeRO-3: copies, the gathered are freed)
        for part in _parts(module):
            for name, tensor in part.tensors().items():
                dense = to_dense_name(part.prefix + name)
                if dense is not None:
                    out[dense] = tensor.detach().clone() if gathered else tensor.detach()
    return out


def load_dense_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    rename: Rename = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Loads a dense state dict into ``module`` of any layout: each tensor-parallel module takes
    its rank's part, every other tensor is copied whole.

    Collective over ``group`` (the world when None): every rank checks first that the dict
    holds every tensor its modules need, with the right shapes, and if any rank finds one
    missing or misshapen, every rank raises, naming them, before anything is changed.
    """
    refuse_dtensors(module, "torch_mp.checkpoint.load_dense_state_dict")
    with whole_parameters(module, write_back=True):  # (ZeRO-3: each rank keeps its range)
        _load_dense_state_dict(module, state_dict, rename, group)


def _load_dense_state_dict(module, state_dict, rename, group) -> None:
    to_dense_name = _renamer(rename)
    parts = _parts(module)
    problems = []
    plan = []
    for part in parts:
        for name, target in part.tensors().items():
            key = to_dense_name(part.prefix + name)
            if key is None:
                continue
            if key not in state_dict:
                problems.append(f"{key} (for {part.prefix}{name}) is missing")
            elif tuple(state_dict[key].shape) != tuple(target.shape):
                problems.append(
                    f"{key} has shape {tuple(state_dict[key].shape)}, {part.prefix}{name} needs "
                    f"{tuple(target.shape)}"
                )
            else:
                plan.append((target, state_dict[key]))
    _raise_anywhere(problems, "torch_mp.checkpoint: cannot load the dense state dict", group)
    with torch.no_grad():
        for target, value in plan:
            target.copy_(value)
        for part in parts:
            if part.twin is not None:
                part.module.load_dense(part.twin)


def _raise_anywhere(problems: list[str], what: str, group: dist.ProcessGroup | None) -> None:
    """Raises on every rank of ``group`` (the world when None) if any rank has problems (each
    naming its own, or the first failing rank's): the core's ``raise_anywhere``."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    _C.raise_anywhere(problems, what, "" if group is None else group.group_name)


def _modules_and_renames(
    model: nn.Module | Sequence[nn.Module], rename: Rename | Sequence[Rename]
) -> list[tuple[nn.Module, Rename]]:
    modules = [model] if isinstance(model, nn.Module) else list(model)
    for module in modules:
        refuse_dtensors(module, "torch_mp.checkpoint")
    if isinstance(rename, (list, tuple)):
        if len(rename) != len(modules):
            raise ValueError(
                f"torch_mp.checkpoint: {len(rename)} renames for {len(modules)} modules"
            )
        return list(zip(modules, rename, strict=True))
    return [(module, rename) for module in modules]
