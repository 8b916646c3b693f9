"""A checkpoint's ``extra.pt``: the ``extra`` object given to save, pickled by ``torch.save``.

A pickle can run any code when it is read, and a checkpoint is a file from elsewhere (a
checksum is no signature: whoever can edit the folder can re-record it). So it is read, by
default, with ``torch.load(..., weights_only=True)``: torch's restricted unpickler, which builds
tensors, numbers, strings, lists, tuples, dicts, ``OrderedDict`` and what the user allow-lists
with ``torch.serialization.add_safe_globals``, and refuses anything else without running it. A
save refuses, by default, an ``extra`` that such a load would refuse, so that a user learns it
at save time, not at resume time.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

import torch


def _refused_types(data: bytes) -> list[str]:
    """The globals (classes, functions) the pickle ``data`` names that torch's restricted
    unpickler does not allow, read from its opcodes without running any; empty when none can
    be told (torch.load's own text then says what is wrong)."""
    try:  # torch.save's format: torch's own scan
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:
        pass
    try:  # a plain pickle: its GLOBAL and STACK_GLOBAL opcodes
        allowed = set(torch._weights_only_unpickler._get_allowed_globals())
    except Exception:
        allowed = set()
    named, strings, memo = [], [], {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                named.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                named.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
                strings.append(arg)
            elif op.name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET") and memo.get(arg):
                strings.append(memo[arg])
    except Exception:  # (a malformed pickle: what was found so far)
        pass
    return sorted({name for name in named if name not in allowed})


def _refusal(data: bytes, what: str, error: Exception) -> str:
    types = _refused_types(data)
    held = f"it holds {', '.join(types)}, " if types else ""
    allow = (
        f"torch.serialization.add_safe_globals([{', '.join(types)}])"
        if types
        else ("torch.serialization.add_safe_globals([...])")
    )
    return (
        f"{what}: {held}which a load with weights_only=True (the default) refuses: torch's "
        f"restricted unpickler runs no code of a file. To allow those types, call {allow} "
        "before the load; for a checkpoint you trust, pass weights_only=False. (The unpickler "
        f"said: {_gist(error)})"
    )


def _gist(error: Exception) -> str:
    """The line of torch.load's refusal that says what it refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (said or lines or [type(error).__name__])[0]


def pickled(extra: Any, *, weights_only: bool = True) -> bytes:
    """``extra`` as ``extra.pt``'s bytes (``torch.save``).

    Raises:
        pickle.PicklingError: With ``weights_only``, if a load with ``weights_only=True`` would
            refuse it, naming the types (allow-list them with
            ``torch.serialization.add_safe_globals``, or save and load with
            ``weights_only=False``).
    """
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    data = buffer.getvalue()
    if weights_only:
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise pickle.PicklingError(
                _refusal(data, "torch_mp.checkpoint.save: extra", e)
                + "; pass weights_only=False to save, too"
            ) from None
    return data


def unpickled(data: bytes, file: str, *, weights_only: bool = True) -> Any:
    """``extra.pt``'s bytes ``data`` (read from ``file``) as the object saved.

    Raises:
        pickle.UnpicklingError: With ``weights_only``, if the pickle names a type torch's
            restricted unpickler does not allow, naming ``file`` and the types; nothing of the
            file runs.
    """
    if not weights_only:  # (only for files you trust: any code the pickle names runs)
        return torch.load(io.BytesIO(data), weights_only=False)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise pickle.UnpicklingError(_refusal(data, file, e)) from None
