"""Checkpoints: a model of any layout (tensor x pipeline x data parallel) to and from files.

- :func:`save` / :func:`load`: a training checkpoint (model, optimizer state, extra) saved
  from one layout and loaded into any other, crash-safe, each rank writing and reading only its
  own parts; the C++ front end (``torch_mp::checkpoint::save`` / ``load``) reads and writes the
  same directories; :func:`consolidate` turns one into a dense file;
- :func:`export_dense` writes the whole model as one plain state dict that the dense model's
  ``load_state_dict`` accepts (safetensors format), and :func:`load_dense` loads such a file
  into any layout.
"""

from torch_mp.checkpoint.dense import (
    dense_state_dict,
    export_dense,
    load_dense,
    load_dense_state_dict,
)
from torch_mp.checkpoint.safetensors import load_file, save_file
from torch_mp.checkpoint.save_load import consolidate, load, save

__all__ = [
    "consolidate",
    "dense_state_dict",
    "export_dense",
    "load",
    "load_dense",
    "load_dense_state_dict",
    "load_file",
    "save",
    "save_file",
]
