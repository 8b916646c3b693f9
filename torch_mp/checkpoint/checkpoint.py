"""Training checkpoints: model, optimizer state and extra, saved from one layout and loaded into
any other (tensor x pipeline x data parallel), crash-safe; and the dense interchange file. The
face of csrc/torch_mp/checkpoint/checkpoint.h: the format is the C++ core's
(``csrc/torch_mp/checkpoint/shards.h``, specified in docs/checkpoint-format.md), which the C++
front end reads and writes too, and ``export_dense`` / ``load_dense`` are the same algorithms as
``torch_mp::checkpoint::export_dense`` / ``load_dense``.

On disk, a directory: one safetensors file per pipeline and tensor rank (``shard-<pp>-<tp>``,
written by data rank 0), holding that rank's parts of its tensors in the dense model's names
(the blocks of a sharded tensor it holds, keyed ``<name>@<dim>:<first index>``; a replicated
tensor whole, from tensor rank 0), ``extra.pt`` and, written last, ``index.json``. No rank
gathers another's tensors: each writes its own, and a load reads only the blocks that overlap
what it holds, so any layout reads what any other wrote.

Optimizer state is kept per parameter, as ``optim/<dense name>/<state>``: a state tensor shaped
like its parameter (Adam's moments) is laid out, and resharded, as the parameter; anything else
(a step count) is kept whole. A ``DistributedOptimizer``'s state is gathered from the data ranks
when saved and each data rank keeps its part when loaded, so a checkpoint does not depend on
the data-parallel size or on whether the optimizer was sharded.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp.checkpoint.dense import (
    Rename,
    _is_parallel,
    _modules_and_renames,
    _raise_anywhere,
    _renamer,
)
from torch_mp.checkpoint.extra import pickled, unpickled
from torch_mp.checkpoint.safetensors import load_file
from torch_mp.checkpoint.verify import warn_if_unchecked
from torch_mp.data_parallel import whole_parameters
from torch_mp.mesh import Mesh, get_mesh
from torch_mp.optim import DistributedOptimizer

EXTRA = "extra.pt"
MODEL = "model/"  # the prefix of the model's tensors in a checkpoint (optim/ for the optimizer's)


def _world_name() -> str:
    return dist.group.WORLD.group_name


def _dense_tensors(module: nn.Module, rename: Rename) -> list[tuple[str, torch.Tensor, bool]]:
    """``module``'s parameters and persistent buffers in the dense model's names, with whether
    each is a parameter; a tensor reached under several names once. A tensor-parallel module's
    tensors are named as in its dense counterpart (its ``DENSE_NAMES`` prefixes, the same names
    otherwise), then ``rename`` applies."""
    to_dense_name = _renamer(rename)
    found: list[tuple[str, torch.Tensor, bool]] = []

    def own(module: nn.Module, recurse: bool):
        yield from ((n, p, True) for n, p in module.named_parameters(recurse=recurse))
        for name, buffer in module.named_buffers(recurse=recurse):
            owner = module.get_submodule(name.rpartition(".")[0]) if recurse else module
            if (
                buffer is not None
                and name.rpartition(".")[2] not in owner._non_persistent_buffers_set
            ):
                yield name, buffer, False

    def walk(module: nn.Module, prefix: str) -> None:
        if _is_parallel(module):
            mapping = sorted(getattr(module, "DENSE_NAMES", {}).items(), key=lambda kv: -len(kv[0]))
            for local, tensor, is_parameter in own(module, True):
                for old, new in mapping:
                    if local.startswith(old):
                        local = new + local[len(old) :]
                        break
                found.append((prefix + local, tensor, is_parameter))
            return
        found.extend((prefix + n, t, p) for n, t, p in own(module, False))
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.")

    walk(module, "")
    out, seen = [], set()
    for name, tensor, is_parameter in found:
        dense = to_dense_name(name)
        if dense is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((dense, tensor, is_parameter))
    return out


def _modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _all_dense_tensors(model, rename) -> list[tuple[str, torch.Tensor, bool]]:
    out = []
    for module, module_rename in _modules_and_renames(model, rename):
        out += _dense_tensors(module, module_rename)
    # (an overlapped all-gather of a DistributedOptimizer's step would write into them later)
    _C.optim.wait_for_gathers([t for _, t, _ in out])
    return out


def _shard(name: str, tensor: torch.Tensor, like: torch.Tensor, mesh: Mesh):
    """The core's Shard of ``tensor`` laid out as the parameter ``like`` (whole, replicated
    over the tensor group, when ``like`` has no recorded layout)."""
    return _C.checkpoint.shard_of(name, tensor.detach(), like, mesh.tp_group.group_name)


def save(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    rename: Rename | Sequence[Rename] = None,
    mesh: Mesh | None = None,
    weights_only: bool = True,
) -> None:
    """Saves ``model`` (this rank's module or pipeline stages), ``optimizer``'s state and
    ``extra`` (what ``torch.load(..., weights_only=True)`` reads back: tensors, numbers,
    strings, lists, tuples, dicts, and types allow-listed with
    ``torch.serialization.add_safe_globals``; a dict's str, int, float and bool items also go,
    as strings, to a C++ ``torch_mp::checkpoint::load``) to the directory ``path``. Collective
    over every rank of the mesh; each rank of data rank 0 writes its own parts, nothing is
    gathered. An ``extra`` that :func:`load`'s default would refuse is refused here, on every
    rank, naming its types, unless ``weights_only=False`` (then it must be loaded with
    ``weights_only=False`` too: only for files you trust).
    ``rename`` maps the stages' names to the dense model's, as for :func:`export_dense`, so that
    the checkpoint loads into any other layout, from Python or C++.

    Crash-safe: the directory is written under a temporary name and renamed into place (over
    an earlier checkpoint at ``path``) only when every rank's file is complete. A failure on
    any rank raises on every rank, naming it, and leaves ``path`` as it was. Every block (and
    ``extra.pt``) is written with its CRC-32C, which :func:`load` and :func:`verify` check.
    An :func:`async_save` still running is waited for first.
    """
    with whole_parameters(_modules(model)):  # (ZeRO-3: sharded parameters gathered)
        request = _save_request(path, model, optimizer, extra, rename, mesh, weights_only)
        _C.checkpoint.save(*request, _world_name())


def async_save(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    rename: Rename | Sequence[Rename] = None,
    mesh: Mesh | None = None,
    weights_only: bool = True,
) -> _C.checkpoint.AsyncSave:
    """:func:`save` in the background: what it will write is copied before it returns (to
    pinned CPU memory from a GPU, a copy on a CPU), so training may change the parameters and
    the optimizer state at once; a thread then writes the copy, crash-safe as :func:`save`.
    Collective over every rank of the mesh, with the same arguments as :func:`save`.

    A save still running is waited for first (and its failure raised, if nobody has waited for
    it); so is one at the end of the program. The background save talks over a Gloo group of
    its own, made the first time.

    Returns:
        A handle: ``handle.wait()`` blocks until the checkpoint is published and raises, on
        every rank alike, what the save raised; ``handle.done()`` says whether it has finished.
    """
    global _waits_at_exit
    if not _waits_at_exit:
        atexit.register(_C.checkpoint.wait_for_pending_save)
        _waits_at_exit = True
    with whole_parameters(_modules(model)):  # (copied before async_save returns)
        request = _save_request(path, model, optimizer, extra, rename, mesh, weights_only)
        # The core makes the background saves' group over the world the first time.
        store = dist.distributed_c10d._get_default_store()
        return _C.checkpoint.async_save(*request, _world_name(), store)


# Whether the program waits for the last background save at its end.
_waits_at_exit = False


def _save_request(path, model, optimizer, extra, rename, mesh, weights_only) -> tuple:
    """The path and what this rank's save writes (the core's SaveRequest)."""
    mesh = mesh or get_mesh()
    shards: list = []
    over_experts: list[bool] = []  # each shard's: a mixture of experts' tensor (expert group)
    values: dict[str, Any] = {}
    problems: list[str] = []
    state = _state_by_parameter(optimizer)

    experts = "" if mesh.ep_group is None else mesh.ep_group.group_name

    def add(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
        shards.append(_shard(name, tensor, like, mesh))
        # (a mixture of experts' tensor: it lies over the expert group)
        over_experts.append(_C.checkpoint.over_expert_group(like, experts))

    with _collected(problems):
        named = _all_dense_tensors(model, rename)
        for name, tensor, _ in named:
            add(MODEL + name, tensor, tensor)
        if optimizer is not None:
            _check_optimizer_named(optimizer, named)
            for name, p, is_parameter in named:
                for key, value in state.get(p, {}).items() if is_parameter else ():
                    full = f"optim/{name}/{key}"
                    if isinstance(value, torch.Tensor):
                        shaped = value.shape == p.shape and value.dim() > 0
                        add(full, value, p if shaped else value)
                    else:
                        values[full] = value
        extra_file = pickled(extra, weights_only=weights_only)
    _raise_anywhere(problems, "torch_mp.checkpoint.save failed", None)
    metadata = {
        "mesh": f"tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size}",
        "saved_by": "torch_mp Python",
        "param_groups": json.dumps(_hyperparameters(optimizer)),
        "values": json.dumps(values),
    }
    if isinstance(extra, dict):  # what the C++ front end reads of it (its load returns strings)
        for key, value in extra.items():
            if isinstance(key, str) and isinstance(value, (str, int, float, bool)):
                metadata[f"extra/{key}"] = str(value)
    # Which files the checkpoint has, which is this rank's, and which shards go into it: the
    # core's plan (place 0 of each (pp, tp)'s data x context group writes all it holds, places
    # 1 .. ep - 1 their experts).
    sizes_and_ranks = {
        f"{d}_{what}": getattr(mesh, f"{d}_{what}")
        for d in ("pp", "tp", "dp", "cp", "ep")
        for what in ("size", "rank")
    }
    mine, files, kept = _C.checkpoint.plan_save(sizes_and_ranks, over_experts)
    shards = [shards[i] for i in kept]
    request = _C.checkpoint.SaveRequest(shards, mine, files, metadata, {EXTRA: extra_file})
    return os.fspath(path), request


def _state_by_parameter(optimizer: torch.optim.Optimizer | None) -> dict:
    """The optimizer's state by parameter; a DistributedOptimizer's gathered from the data
    ranks (collective over its group), as a plain optimizer would hold it."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.gathered_state()
    return optimizer.state


def _hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict]:
    if optimizer is None:
        return []
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                k: v
                for k, v in group.items()
                if k != "params" and isinstance(v, (int, float, bool, str, type(None), list, tuple))
            }
        )
    return groups


def load(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rename: Rename | Sequence[Rename] = None,
    mesh: Mesh | None = None,
    weights_only: bool = True,
) -> Any:
    """Loads a checkpoint written by :func:`save` (or by the C++ front end), from any layout,
    into ``model`` (this rank's module or pipeline stages, ``rename`` as when saving) and
    ``optimizer`` (its state tensors resharded with their parameters, its hyperparameters
    restored). Collective over every rank; each reads only the parts it needs.

    A checkpoint is a file from elsewhere, and nothing in it runs: ``extra.pt`` is read with
    ``torch.load(..., weights_only=True)`` (torch's restricted unpickler), before anything of
    the model changes. ``weights_only=False`` unpickles it in full, which runs whatever code
    the pickle names: only for checkpoints you trust.

    Returns:
        The ``extra`` given to :func:`save` (for a checkpoint saved from C++, its ``extra``
        strings as a dict).

    Raises:
        RuntimeError: On every rank, if the checkpoint is incomplete (no index: a save that did
            not finish; a shard file missing) or lacks a tensor this layout needs, naming it;
            nothing is changed then. Likewise, naming the file, if ``extra.pt`` holds a type
            that ``weights_only=True`` refuses (and how to allow it), or a file is malformed
            (docs/checkpoint-format.md §12). On every rank too if a block read fails its
            checksum (a damaged file), naming the file and the tensor.

    Warns:
        UserWarning: If the checkpoint records no checksums (saved by an older torch_mp): it
            loads, but cannot be verified.
    """
    mesh = mesh or get_mesh()
    reader = _C.checkpoint.Reader(os.fspath(path), _world_name())
    warn_if_unchecked(reader)
    metadata = reader.metadata
    shards: list = []
    states: list[tuple[nn.Parameter, str, torch.Tensor]] = []
    problems: list[str] = []
    with whole_parameters(_modules(model), write_back=True):  # (ZeRO-3: each keeps its range)
        with _collected(problems):
            extra = reader.root_file(EXTRA)  # checked by its checksum, before anything changes
            if extra is not None:
                file = os.path.join(reader.path, EXTRA)
                # (in a tuple: a saved None is a value, no extra.pt is none)
                extra = (unpickled(extra, file, weights_only=weights_only),)
            named = _all_dense_tensors(model, rename)
            shards += [_shard(MODEL + name, tensor, tensor, mesh) for name, tensor, _ in named]
            if optimizer is not None:
                _check_hyperparameters(optimizer, metadata)
                states = _optimizer_shards(optimizer, named, reader.tensors, mesh, shards)
        _raise_anywhere(problems, f"torch_mp.checkpoint: cannot load {reader.path}", None)
        reader.load(shards, _world_name())
    if optimizer is not None:
        groups = json.loads(metadata.get("param_groups", "[]"))
        for group, saved_group in zip(optimizer.param_groups, groups, strict=False):  # [] from C++
            for key, value in saved_group.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        loaded: dict[torch.Tensor, dict[str, Any]] = {}
        for p, key, value in states:
            loaded.setdefault(p, {})[key] = value
        values = json.loads(metadata.get("values", "{}"))
        for name, p, is_parameter in named:
            for key, value in values.items():
                if is_parameter and key.startswith(f"optim/{name}/"):
                    loaded.setdefault(p, {})[key.rsplit("/", 1)[1]] = value
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.load_gathered_state(loaded)  # each data rank keeps its shards' part
        else:
            for p, state in loaded.items():
                optimizer.state[p].update(state)
    if extra is not None:
        return extra[0]
    return {k[len("extra/") :]: v for k, v in metadata.items() if k.startswith("extra/")}


@contextlib.contextmanager
def _collected(problems: list[str]) -> Iterator[None]:
    """Turns an exception into one of ``problems``, which every rank then hears of: a rank that
    raised alone would leave the others waiting in the next collective."""
    try:
        yield
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")


def _check_optimizer_named(optimizer: torch.optim.Optimizer, named) -> None:
    held = {id(t) for _, t, is_parameter in named if is_parameter}
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in held]
    if outside:
        raise RuntimeError(
            f"the optimizer holds {len(outside)} parameters (shapes "
            f"{[tuple(p.shape) for p in outside[:4]]}) that the model does not name; their "
            "state would be lost"
        )


def _optimizer_shards(optimizer, named, saved: dict, mesh: Mesh, shards: list) -> list:
    """Appends to ``shards`` a tensor for every state tensor the checkpoint holds for a
    parameter of ``named``; returns (parameter, state name, tensor) for each. A tensor shaped
    like its dense parameter is laid out as the parameter, on its device; anything else is
    read whole: a step count on the CPU, as torch's optimizers keep it unless fused or
    capturable."""
    on_device = {
        id(p)
        for g in optimizer.param_groups
        if g.get("fused") or g.get("capturable")
        for p in g["params"]
    }
    states = []
    for name, p, is_parameter in named:
        prefix = f"optim/{name}/"
        if not is_parameter or MODEL + name not in saved:
            continue  # (a missing parameter is named by reader.load)
        dense_shape = saved[MODEL + name][1]
        for key, (dtype, shape) in saved.items():
            if not key.startswith(prefix):
                continue
            state = key[len(prefix) :]
            if len(shape) > 0 and shape == dense_shape:  # laid out as the parameter
                value = torch.empty_like(p, dtype=dtype)
                shards.append(_shard(key, value, p, mesh))
            else:
                cpu = state == "step" and id(p) not in on_device
                value = torch.empty(shape, dtype=dtype, device="cpu" if cpu else p.device)
                shards.append(_shard(key, value, value, mesh))
            states.append((p, state, value))
    return states


def _check_hyperparameters(optimizer: torch.optim.Optimizer, metadata: dict[str, str]) -> None:
    """Raises (on every rank alike) unless the checkpoint's optimizer had as many parameter
    groups as ``optimizer``; one saved without hyperparameters (from C++) fits any."""
    groups = json.loads(metadata.get("param_groups", "[]"))
    if groups and len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"torch_mp.checkpoint.load: the checkpoint's optimizer has {len(groups)} parameter "
            f"groups, this one {len(optimizer.param_groups)}"
        )


def consolidate(source: str | os.PathLike, path: str | os.PathLike, *, prefix: str = MODEL) -> None:
    """Writes the checkpoint ``source`` (a directory :func:`save` wrote, from any layout, or
    from C++) as one dense safetensors file at ``path``: the dense model's state dict, which
    its ``load_state_dict`` and :func:`load_dense` take. Not collective: this process reads
    every shard file. ``prefix="optim/"`` writes the optimizer's state instead, keyed
    ``<parameter>/<state>``."""
    _C.checkpoint.consolidate(os.fspath(source), os.fspath(path), prefix)


def export_dense(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    *,
    rename: Rename | Sequence[Rename] = None,
    mesh: Mesh | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Writes the whole model as one dense state dict, in the safetensors format, to ``path``.

    Collective over every rank of the mesh. ``model`` is this rank's module or its pipeline
    stage modules; ``rename`` (one for all, or one per module) maps their parameter names to
    the dense model's, so that the file's keys are what the dense model's ``load_state_dict``
    takes. As the C++ front end's ``torch_mp::checkpoint::export_dense`` does it: every rank
    writes its parts beside the file (a checkpoint, as :func:`save` writes it, at
    ``<path>.parts``), then rank 0 joins them (:func:`consolidate`), writing the file atomically
    (a crash leaves the previous file whole), and removes the parts. ``metadata`` goes into the
    file's header beside ``format: torch_mp dense``.

    Returns:
        The dense state dict on rank 0 (read back from the file), None elsewhere.

    Raises:
        RuntimeError: On every rank, if two stages give one name different values (a head
            tied to an embedding that it no longer equals), naming it.
    """
    mesh = mesh or get_mesh()
    path = os.fspath(path)
    parts = path + ".parts"
    save(parts, model, rename=rename, mesh=mesh)
    problems: list[str] = []
    first = dist.get_rank() == 0
    if first:
        with _collected(problems):
            _C.checkpoint.consolidate(parts, path, MODEL, dict(metadata or {}))
            shutil.rmtree(parts)
    _raise_anywhere(problems, f"torch_mp.checkpoint.export_dense to {path} failed", None)
    return load_file(path)[0] if first else None


def load_dense(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    *,
    rename: Rename | Sequence[Rename] = None,
    mesh: Mesh | None = None,
) -> None:
    """Loads a dense safetensors file (:func:`export_dense`'s, or one written from a dense
    model's ``state_dict``) into ``model`` of any layout: this rank's module or pipeline stages,
    with ``rename`` as for :func:`export_dense`. Collective over every rank; each reads only
    the blocks of the tensors it holds, straight into them (``torch_mp::checkpoint::load_dense``
    does the same). A missing or misshapen tensor raises on every rank, naming it, before
    anything changes."""
    mesh = mesh or get_mesh()
    reader = _C.checkpoint.Reader(os.fspath(path), _world_name(), MODEL)
    warn_if_unchecked(reader)
    shards: list = []
    problems: list[str] = []
    with whole_parameters(_modules(model), write_back=True):  # (ZeRO-3: each keeps its range)
        with _collected(problems):
            named = _all_dense_tensors(model, rename)
            shards += [_shard(MODEL + name, tensor, tensor, mesh) for name, tensor, _ in named]
        _raise_anywhere(problems, f"torch_mp.checkpoint: cannot load {reader.path}", None)
        reader.load(shards, _world_name())
