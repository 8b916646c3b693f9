"""The safetensors file format, read and written without the ``safetensors`` package (the C++
front end reads and writes the same bytes): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8 bytes, then the tensors' bytes, little-endian, C order.

Writes are atomic: the file is written beside its destination under a temporary name, flushed
to disk and renamed over it, so a process killed mid-write leaves the previous file whole.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}


def save_file(
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes ``tensors`` (any device; written from CPU copies) to ``path``, atomically."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"safetensors: {name} has dtype {tensor.dtype}, which it cannot hold")
        data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def load_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Reads a safetensors file: its tensors (on CPU) and its metadata.

    Raises:
        ValueError: If the file is not safetensors or is cut short, naming what is wrong.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file ({len(data)} bytes)")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise ValueError(f"{path}: not a safetensors file, or cut short (header of {length} bytes)")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from e
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if end > len(body) or entry["dtype"] not in _TORCH:
            raise ValueError(f"{path}: tensor {name} is cut short or of unknown dtype")
        dtype = _TORCH[entry["dtype"]]
        if end == begin:  # an empty tensor (frombuffer refuses an empty buffer)
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(entry["shape"])
    return tensors, metadata
