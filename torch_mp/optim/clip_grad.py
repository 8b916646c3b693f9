"""Mesh-wide gradient clipping (the norm over every stage, shard and replica, in the C++ core)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from torch_mp import _C
from torch_mp.layout import refuse_dtensors
from torch_mp.mesh import Mesh, get_mesh


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    mesh: Mesh | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model spread over the mesh.

    The total norm is that of the dense model's gradients: sharded parameters contribute every
    rank's part, replicated ones (and parameters of plain modules) count once, the last stage's
    copy of a tied parameter not at all, and the pipeline stages' parts are combined; a mixture
    of experts' experts (sharded over the mesh's expert group, :mod:`torch_mp.moe`) are summed
    over it, each of its ranks holding other experts. Every rank of the model gets the same norm
    and scales its gradients by the same factor. Collective over the mesh's tensor, pipeline
    (and expert) groups: call it on every rank.

    Args:
        parameters: This rank's parameters (of all its stages).
        max_norm: The largest total norm allowed.
        norm_type: The order of the norm; ``float("inf")`` for the largest absolute entry.
        mesh: The mesh; the default one when None.
        error_if_nonfinite: Raise (on every rank) instead of returning a NaN or infinite norm.

    Returns:
        The total norm before clipping (a float32 scalar).

    Raises:
        RuntimeError: With ``error_if_nonfinite``, when the norm is NaN or infinite; when a
            sharded parameter's group is neither the mesh's tensor group nor its expert group.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    refuse_dtensors(parameters, "torch_mp.clip_grad_norm_")
    mesh = mesh if mesh is not None else get_mesh()
    return _C.clip_grad_norm_(
        parameters,
        float(max_norm),
        float(norm_type),
        mesh.tp_group.group_name,
        mesh.pp_group.group_name,
        error_if_nonfinite,
        mesh.ep_group.group_name if mesh.ep_group is not None else None,
    )
