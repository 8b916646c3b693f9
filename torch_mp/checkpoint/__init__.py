"""Checkpoints: a model of any layout (tensor x pipeline x data parallel) to and from files.

- :func:`save` / :func:`load`: a training checkpoint (model, optimizer state, extra) saved
  from one layout and loaded into any other, crash-safe, each rank writing and reading only its
  own parts; the C++ front end (``torch_mp::checkpoint::save`` / ``load``) reads and writes the
  same directories; :func:`consolidate` turns one into a dense file;
- :func:`async_save`: :func:`save` from a snapshot, written in the background while training
  goes on; :func:`verify` checks a whole checkpoint against the CRC-32C saved with every block
  (which :func:`load` checks too), also ``python -m torch_mp.checkpoint verify PATH``;
- :func:`export_dense` writes the whole model as one plain state dict that the dense model's
  ``load_state_dict`` accepts (safetensors format), and :func:`load_dense` loads such a file
  into any layout; :func:`dense_state_dict` / :func:`load_dense_state_dict` do the same in
  memory.

The format is specified in docs/checkpoint-format.md.
"""

from torch_mp.checkpoint.checkpoint import (
    async_save,
    consolidate,
    export_dense,
    load,
    load_dense,
    save,
)
from torch_mp.checkpoint.dense import dense_state_dict, load_dense_state_dict
from torch_mp.checkpoint.safetensors import load_file, save_file
from torch_mp.checkpoint.verify import CorruptBlock, verify

__all__ = [
    "CorruptBlock",
    "async_save",
    "consolidate",
    "dense_state_dict",
    "export_dense",
    "load",
    "load_dense",
    "load_dense_state_dict",
    "load_file",
    "save",
    "save_file",
    "verify",
]
