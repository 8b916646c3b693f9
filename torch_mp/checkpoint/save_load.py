"""Training checkpoints: model, optimizer state and extra, saved from one layout and loaded into
any other (tensor x pipeline x data parallel), crash-safe.

Layout on disk: a directory holding one safetensors file per pipeline stage rank (written by
that stage's tensor and data rank 0, with the stage's tensors in the dense model's names,
gathered over its tensor group only), ``extra.pt`` and, written last, ``index.json``: which
file holds which tensor, the optimizer's hyperparameters, the mesh it was saved from. The
directory is built under a temporary name and renamed into place when every rank is done, so
a save killed at any point leaves the previous checkpoint loadable; a directory without its
index (or with a file missing) is refused, naming what is missing.

Optimizer state is kept per parameter, in the parameter's dense name: a state tensor shaped
like its parameter (Adam's moments) is resharded with it, anything else (a step count) is
taken as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_mp.checkpoint.dense import (
    Rename,
    _is_parallel,
    _modules_and_renames,
    _raise_anywhere,
    _renamer,
    dense_state_dict,
    load_dense_state_dict,
)
from torch_mp.checkpoint.safetensors import load_file, save_file
from torch_mp.mesh import Mesh, get_mesh

FORMAT = "torch_mp checkpoint"
VERSION = 1
INDEX = "index.json"


@contextlib.contextmanager
def _swapped(values: dict[nn.Parameter, torch.Tensor]) -> Iterator[None]:
    """Parameters temporarily holding other tensors of their shape and dtype (optimizer state),
    so that the modules' dense conversions apply to those. (Another dtype would make autograd
    drop the parameters' gradient accumulators, and with them the hooks of data-parallel
    gradient reduction.)"""
    for p, value in values.items():
        if value.dtype != p.dtype or value.shape != p.shape:
            raise RuntimeError(
                f"torch_mp.checkpoint: optimizer state of {value.dtype} {tuple(value.shape)} for "
                f"a {p.dtype} {tuple(p.shape)} parameter: state in another dtype or shape than "
                "its parameter is not supported yet"
            )
    kept = {p: p.data for p in values}
    try:
        for p, value in values.items():
            p.data = value
        yield
    finally:
        for p, data in kept.items():
            p.data = data


def _shaped_state(optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The names of the optimizer's state tensors that are shaped like their parameter (Adam's
    moments), which are resharded with it."""
    if optimizer is None:
        return []
    names: set[str] = set()
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                names.add(key)
    return sorted(names)


def _dense_names(module: nn.Module, rename: Rename) -> dict[nn.Parameter, str]:
    """Each parameter of ``module`` that has a dense name, by identity. A tensor-parallel
    module's parameters are named as in its dense counterpart (its ``DENSE_NAMES`` prefixes,
    the same names otherwise); the first name of a parameter shared under several is kept."""
    to_dense_name = _renamer(rename)
    names: dict[nn.Parameter, str] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        if _is_parallel(module):
            mapping = sorted(getattr(module, "DENSE_NAMES", {}).items(), key=lambda kv: -len(kv[0]))
            for local, p in module.named_parameters():
                for old, new in mapping:
                    if local.startswith(old):
                        local = new + local[len(old) :]
                        break
                dense = to_dense_name(prefix + local)
                if dense is not None:
                    names.setdefault(p, dense)
            return
        for name, p in module.named_parameters(recurse=False):
            dense = to_dense_name(prefix + name)
            if dense is not None:
                names.setdefault(p, dense)
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.")

    walk(module, "")
    return names


def save(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    rename: Rename | Sequence[Rename] = None,
    mesh: Mesh | None = None,
) -> None:
    """Saves ``model`` (this rank's module or pipeline stages), ``optimizer``'s state and
    ``extra`` (anything ``torch.save`` takes) to the directory ``path``. Collective over every
    rank of the mesh. ``rename`` maps the stages' names to the dense model's, as for
    :func:`export_dense`, so that the checkpoint loads into any other layout.

    Crash-safe: the directory is written under a temporary name and renamed into place (over
    an earlier checkpoint at ``path``) only when complete.
    """
    mesh = mesh or get_mesh()
    path = os.path.abspath(os.fspath(path))
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    partial = f"{path}.partial-{token[0]}"
    if dist.get_rank() == 0:
        os.makedirs(partial)
    dist.barrier()

    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    problems: list[str] = []
    state_names = _shaped_state(optimizer)
    for module, module_rename in _modules_and_renames(model, rename):
        for key, value in dense_state_dict(module, module_rename).items():
            tensors[f"model/{key}"] = value.cpu()
        if optimizer is None:
            continue
        names = _dense_names(module, module_rename)
        unknown = sorted(n for n in names.values() if f"model/{n}" not in tensors)
        if unknown:  # a module whose to_dense names differ and that does not say how
            problems.append(
                f"no dense tensor is named {', '.join(unknown[:4])}: does a tensor-parallel "
                "module lack DENSE_NAMES?"
            )
        for state_name in state_names:
            swap = {}
            for p in names:
                state = optimizer.state.get(p, {})
                swap[p] = state[state_name] if state_name in state else torch.zeros_like(p)
            with _swapped(swap):
                dense = dense_state_dict(module, module_rename)
            for p, key in names.items():
                if state_name in optimizer.state.get(p, {}):
                    tensors[f"optim/{key}/{state_name}"] = dense[key].cpu()
        for p, key in names.items():
            for state_name, value in optimizer.state.get(p, {}).items():
                if state_name in state_names:
                    continue
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{key}/{state_name}"] = value.detach().cpu().clone()
                else:
                    others[f"optim/{key}/{state_name}"] = value

    writes = mesh.tp_rank == 0 and mesh.dp_rank == 0 and not problems
    name = f"stage-{mesh.pp_rank}.safetensors"
    if writes:
        try:
            save_file(tensors, os.path.join(partial, name))
        except Exception as e:  # every rank must hear of it
            problems.append(f"writing {name} failed: {type(e).__name__}: {e}")
    listing = [None] * dist.get_world_size()
    mine = (name, sorted(tensors), others, problems) if writes else (None, [], {}, problems)
    dist.all_gather_object(listing, mine)
    failed = [f"rank {r}: {p}" for r, e in enumerate(listing) for p in e[3]]
    if failed:  # no rank finishes a checkpoint that lacks a file: the previous one stays
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"torch_mp.checkpoint.save failed: {'; '.join(failed)}")
    if dist.get_rank() == 0:
        try:
            index = {
                "format": FORMAT,
                "version": VERSION,
                "mesh": {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size},
                "files": {},
                "values": {},
                "param_groups": _hyperparameters(optimizer),
            }
            for file, keys, values, _ in listing:
                if file is None:
                    continue
                for key in keys:
                    index["files"].setdefault(key, file)
                index["values"].update(values)
            torch.save(extra, os.path.join(partial, "extra.pt"))
            with open(os.path.join(partial, INDEX), "w") as f:
                json.dump(index, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _move_into_place(partial, path)
        except Exception as e:
            problems.append(f"finishing {path} failed: {type(e).__name__}: {e}")
    _raise_anywhere(problems, "torch_mp.checkpoint.save failed", None)
    dist.barrier()


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


def _move_into_place(partial: str, path: str) -> None:
    """Renames the finished ``partial`` to ``path``, the earlier checkpoint there (if any) out
    of the way first and removed last: at every moment either ``path`` or that earlier one is
    complete and loadable."""
    previous = None
    if os.path.exists(path):
        previous = f"{path}.previous-{os.path.basename(partial).rsplit('-', 1)[-1]}"
        os.rename(path, previous)
    os.rename(partial, path)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def _checkpoint_dir(path: str) -> str:
    """``path``, or the earlier checkpoint set aside while a newer one was moved into place
    (a save killed between its two renames)."""
    if os.path.isdir(path):
        return path
    parent, base = os.path.split(path)
    aside = sorted(
        name for name in os.listdir(parent or ".") if name.startswith(f"{base}.previous-")
    )
    if aside:
        return os.path.join(parent, aside[-1])
    raise FileNotFoundError(f"torch_mp.checkpoint.load: no checkpoint at {path}")


def load(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rename: Rename | Sequence[Rename] = None,
) -> Any:
    """Loads a checkpoint written by :func:`save`, from any layout, into ``model`` (this rank's
    module or pipeline stages, ``rename`` as when saving) and ``optimizer`` (its state tensors
    resharded with their parameters, its hyperparameters restored). Collective over every rank.

    Returns:
        The ``extra`` given to :func:`save`.

    Raises:
        RuntimeError: On every rank, if the checkpoint is incomplete (no index: a save that did
            not finish) or lacks a tensor this layout needs, naming it; nothing is changed then.
    """
    path = os.path.abspath(os.fspath(path))
    directory = _checkpoint_dir(path)
    index_path = os.path.join(directory, INDEX)
    problems = []
    index: dict = {}
    if not os.path.exists(index_path):
        problems.append(f"{directory} has no {INDEX}: the save that wrote it did not finish")
    else:
        with open(index_path) as f:
            index = json.load(f)
        if index.get("format") != FORMAT:
            problems.append(f"{index_path} is not a {FORMAT} index")
        missing = sorted(
            {file for file in index.get("files", {}).values()} - set(os.listdir(directory))
        )
        if missing:
            problems.append(f"{directory} lacks {', '.join(missing)}")
    _raise_anywhere(problems, "torch_mp.checkpoint.load: incomplete checkpoint", None)

    files = sorted(set(index["files"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:  # every rank reads every stage file it may need
        loaded, _ = load_file(os.path.join(directory, file))
        for key, value in loaded.items():
            tensors.setdefault(key, value)
    model_state = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    pairs = _modules_and_renames(model, rename)
    for module, module_rename in pairs:
        load_dense_state_dict(module, model_state, module_rename)
    if optimizer is not None:
        _load_optimizer(optimizer, pairs, tensors, index)
    return torch.load(os.path.join(directory, "extra.pt"), weights_only=False)


def _load_optimizer(optimizer, pairs, tensors: dict[str, torch.Tensor], index: dict) -> None:
    groups = index.get("param_groups", [])
    problems = []
    if len(groups) != len(optimizer.param_groups):
        problems.append(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    _raise_anywhere(problems, "torch_mp.checkpoint.load: optimizer mismatch", None)
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    values = index.get("values", {})
    for module, module_rename in pairs:
        names = _dense_names(module, module_rename)  # parameter -> dense name
        state_names = sorted(
            {
                key.rsplit("/", 1)[1]
                for key in tensors
                for name in names.values()
                if key.startswith(f"optim/{name}/")
            }
        )
        for state_name in state_names:
            present = {
                name: tensors[f"optim/{name}/{state_name}"]
                for name in names.values()
                if f"optim/{name}/{state_name}" in tensors
            }
            if all(t.dim() > 0 for t in present.values()):
                # Shaped like the parameters: resharded as they are, through load_dense.
                swap = {p: torch.empty_like(p) for p in names}
                full = dense_state_dict(module, module_rename)
                full.update(present)
                with _swapped(swap):
                    load_dense_state_dict(module, full, module_rename)
                for p, name in names.items():
                    if name in present:
                        optimizer.state[p][state_name] = swap[p]
            else:
                for p, name in names.items():
                    if name in present:
                        optimizer.state[p][state_name] = present[name].clone()
        for p, name in names.items():
            for key, value in values.items():
                if key.startswith(f"optim/{name}/"):
                    optimizer.state[p][key.rsplit("/", 1)[1]] = value
