"""Pipeline stages from ``torch.distributed.pipelining``'s tracer: the way to pipeline a model
that is not an ``nn.Sequential`` (a Hugging Face model, say) with torch_mp's Pipeline::

    from torch.distributed.pipelining import SplitPoint, pipeline as trace
    traced = trace(model, mb_args=(micro_batch,), split_spec={"layers.4": SplitPoint.BEGINNING})
    stage = torch_mp.pipeline.traced_stage(traced, mesh.pp_rank)
    pipe = torch_mp.pipeline.Pipeline(stage, "1f1b", num_microbatches, loss_fn, mesh=mesh)

The tracer cuts the model's graph into stage modules; a stage may read a value that an earlier
stage, not the one before it, produced (GPT-2's attention mask, made by the first stage, is read
by every later one). torch_mp's pipeline passes each stage's outputs to the next stage only, so
each stage returned here also passes on, unchanged, the values that later stages read. The
tracer specialises the graph to ``mb_args``' shapes: trace with one micro-batch.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

__all__ = ["TracedStage", "traced_stage"]


class TracedStage(nn.Module):
    """One stage of a traced model: runs the tracer's stage module on the values it receives and
    returns its outputs with the values later stages read.

    Args:
        module: The tracer's module of this stage (``Pipe.get_stage_module(index)``).
        receives: Names of the values this stage is given, in order (the model's inputs for the
            first stage).
        takes: Names of the values the stage module is called with, in order.
        makes: The names of the stage module's outputs that are used, by their position in the
            tuple it returns (position None: it returns a single tensor).
        sends: Names of the values this stage returns, in order (to the next stage).
    """

    def __init__(
        self,
        module: nn.Module,
        receives: list[str],
        takes: list[str],
        makes: dict[str, int | None],
        sends: list[str],
    ) -> None:
        super().__init__()
        self.module = module
        self.receives, self.takes, self.makes, self.sends = receives, takes, makes, sends

    def forward(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.receives):
            raise ValueError(
                f"TracedStage: given {len(inputs)} tensors, expected {len(self.receives)} "
                f"({', '.join(self.receives)})"
            )
        values = dict(zip(self.receives, inputs, strict=True))
        made = self.module(*(values[name] for name in self.takes))
        values.update(
            (name, made if position is None else made[position])
            for name, position in self.makes.items()
        )
        out = tuple(values[name] for name in self.sends)
        return out[0] if len(out) == 1 else out


def _stage_calls(graph: fx.Graph) -> tuple[list[str], list[fx.Node]]:
    """The model's input names and the stages' call nodes, in order."""
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    calls = [n for n in graph.nodes if n.op == "call_module"]
    return inputs, calls


def _value_name(node: fx.Node) -> str:
    """A stage's argument: a model input, a stage's only output, or one of a stage's outputs
    (``getitem``)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return f"{node.args[0].name}[{node.args[1]}]"
    if node.op in ("placeholder", "call_module"):
        return node.name
    raise ValueError(f"traced_stage: a stage reads {node.format_node()}, not a value of a stage")


def traced_stage(traced, index: int) -> TracedStage:
    """Stage ``index`` of ``traced`` (what ``torch.distributed.pipelining.pipeline`` returns),
    for :class:`torch_mp.pipeline.Pipeline`: it receives what stage ``index - 1`` returns (the
    model's inputs on the first stage) and returns what stage ``index + 1`` needs (its outputs,
    and the earlier values later stages read); the last stage returns the model's output.

    Raises:
        ValueError: If ``index`` is not a stage of ``traced``, or a stage reads something that is
            neither a model input nor a stage's output.
    """
    inputs, calls = _stage_calls(traced.split_gm.graph)
    if not 0 <= index < len(calls):
        raise ValueError(f"traced_stage: stage {index} of a model traced into {len(calls)}")
    takes = [[_value_name(arg) for arg in call.args] for call in calls]
    makes: list[dict[str, int | None]] = []
    for call in calls:
        picked = sorted(
            (u for u in call.users if u.target is operator.getitem), key=lambda u: u.args[1]
        )
        makes.append({_value_name(u): u.args[1] for u in picked} or {call.name: None})
    available = list(inputs)  # what exists after each stage, in the order it was made
    crossing: list[list[str]] = []  # what crosses each boundary
    for k in range(len(calls)):
        available += [name for name in makes[k] if name not in available]
        later = {name for j in range(k + 1, len(calls)) for name in takes[j]}
        crossing.append([name for name in available if name in later])
    receives = inputs if index == 0 else crossing[index - 1]
    sends = list(makes[index]) if index == len(calls) - 1 else crossing[index]
    module = traced.get_stage_module(index)
    return TracedStage(module, receives, takes[index], makes[index], sends)
