"""A checkpoint's integrity: :func:`verify` checks every block of a checkpoint directory or a
dense file against the CRC-32C saved with it (the C++ core's ``torch_mp::checkpoint::verify``),
listing each :class:`CorruptBlock`; reads of files without checksums are warned of."""

from __future__ import annotations

import os
import warnings

from torch_mp import _C


def warn_if_unchecked(reader) -> None:
    """Warns if files that ``reader`` (a ``_C.checkpoint.Reader``) reads record no checksums."""
    unchecked = reader.unchecked_files
    if unchecked:
        warnings.warn(
            f"torch_mp.checkpoint: {reader.path} records no checksums, or not all of them (saved "
            "by an older torch_mp, or by another program), so what is read of it cannot be "
            "verified: " + ", ".join(os.path.basename(f) for f in unchecked),
            stacklevel=3,
        )


class CorruptBlock(str):
    """A part of a checkpoint that fails its check, as :func:`verify` lists it: the message
    (naming the file and the tensor), with its parts as attributes.

    Attributes:
        file: The file, relative to the checkpoint directory (a dense file: its path).
        key: The tensor's key in the file (``<name>@<dim>:<first index>`` for a block of a
            sharded tensor); empty when the file as a whole is bad (missing, unreadable).
        tensor: The dense name of the tensor the block belongs to (empty as for ``key``).
    """

    file: str
    key: str
    tensor: str

    def __new__(cls, message: str, file: str = "", key: str = "", tensor: str = "") -> CorruptBlock:
        self = super().__new__(cls, message)
        self.file, self.key, self.tensor = file, key, tensor
        return self

    def __reduce__(self):
        return CorruptBlock, (str(self), self.file, self.key, self.tensor)


def verify(path: str | os.PathLike, *, threads: int | None = None) -> list[CorruptBlock]:
    """Checks every block of the checkpoint directory (or dense file) ``path`` against the
    checksum saved with it, without loading it into a model: each shard file's header and
    tensor blocks, ``extra.pt``, the index. Not collective; the files are read ``threads`` at
    a time (one per core when None). ``python -m torch_mp.checkpoint verify PATH`` does the
    same from a shell.

    Returns:
        Every corrupt block (or missing or unreadable file), in file order; empty when the
        checkpoint is intact.

    Raises:
        RuntimeError: If there is no checkpoint or file at ``path``.

    Warns:
        UserWarning: If files record no checksums (saved by an older torch_mp, or by another
            program): they could not be verified.
    """
    report = _C.checkpoint.verify(os.fspath(path), threads or 0)
    if report.unchecked:
        warnings.warn(
            f"torch_mp.checkpoint.verify: {os.fspath(path)} has files without checksums, which "
            "cannot be verified: " + ", ".join(report.unchecked),
            stacklevel=2,
        )
    return [CorruptBlock(b.message, b.file, b.key, b.tensor) for b in report.corrupt]
