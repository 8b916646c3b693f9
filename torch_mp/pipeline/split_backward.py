"""The zero-bubble split of a backward into B (input gradients) and W (weight gradients), each
doing its own share of the work once (the C++ core's csrc/torch_mp/split_backward.h).

The Pipeline runs it for the zero-bubble schedules; it is exposed for custom executors and for
measuring what the split costs::

    out = stage(x)                                     # x a leaf that requires grad
    (dx,), work = backward_input([out], [dout], [x], list(stage.parameters()))
    ...                                                # dx goes to the previous stage
    backward_weight(work)                              # accumulates every parameter's .grad
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_mp._C import pipeline as _core

WeightWork = _core.WeightWork


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    parameters: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of ``inputs`` (leaves that require grad) from those of ``outputs``,
    computing no gradient of ``parameters``.

    Returns:
        The input gradients (None where an input gets none) and what W needs; the graph is kept
        until :func:`backward_weight` runs it.
    """
    return _core.backward_input(list(outputs), list(output_grads), list(inputs), list(parameters))


def backward_weight(work: WeightWork) -> None:
    """W: accumulates the parameters' ``.grad`` from what :func:`backward_input` kept, walking
    only the parameter side of the graph, and frees the graph."""
    _core.backward_weight(work)
