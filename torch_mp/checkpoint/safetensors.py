"""The safetensors file format, read and written by the C++ core
(csrc/torch_mp/checkpoint/safetensors.h; the ``safetensors`` package reads and writes the same
bytes): an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces to a multiple of 8
bytes, then the tensors' bytes, little-endian, C order.

Writes are atomic: the file is written beside its destination under a temporary name, flushed
to disk and renamed over it, so a process killed mid-write leaves the previous file whole.
Every tensor's CRC-32C is recorded in the metadata entry ``torch_mp.crc32c`` and checked when
it is read (docs/checkpoint-format.md §9.1). A file is read as untrusted input: exactly what the
safetensors package reads is read, and everything it refuses is refused (§9.2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from torch_mp import _C

__all__ = ["load_file", "save_file"]


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` (any device; written from CPU copies), their CRC-32C and
    ``metadata`` to ``path``, atomically.

    Raises:
        RuntimeError: On a dtype safetensors cannot hold (every dtype torch has a safetensors
            name for can: docs/checkpoint-format.md §9), metadata under the reserved key
            ``torch_mp.crc32c``, or an I/O error, naming the tensor or file.
    """
    _C.checkpoint.save_file(
        {str(name): tensor.detach() for name, tensor in tensors.items()},
        os.fspath(path),
        {str(k): str(v) for k, v in (metadata or {}).items()},
    )


def load_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Reads a safetensors file: its tensors (on the CPU) and its metadata (without the
    checksums).

    Raises:
        RuntimeError: If the file cannot be read, is not a valid safetensors file (whatever
            the safetensors package refuses: docs/checkpoint-format.md §9.2), or a tensor
            fails its checksum, naming the file and what is wrong.
    """
    tensors, metadata = _C.checkpoint.load_file(os.fspath(path))
    return dict(tensors), dict(metadata)
