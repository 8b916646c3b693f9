"""Each layer's options are declared once, in C++ (csrc/torch_mp/options.h): the Python module's
constructor, its operator's schema and from_dense all take exactly the declared options."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from reference import use_mesh
from torch import nn

import torch_mp
from torch_mp import _C
from torch_mp.tensor_parallel import LayerNorm

# Every layer module, and the operator its forward calls (None: a composition of layers).
LAYERS = {
    torch_mp.ColumnParallelLinear: "column_parallel_linear",
    torch_mp.RowParallelLinear: "row_parallel_linear",
    torch_mp.ColumnParallelConv2d: "column_parallel_conv2d",
    torch_mp.RowParallelConv2d: "row_parallel_conv2d",
    torch_mp.VocabParallelEmbedding: "vocab_parallel_embedding",
    LayerNorm: "layer_norm",
    torch_mp.ParallelSelfAttention: "parallel_self_attention",
    torch_mp.ParallelMLP: "parallel_mlp",
    torch_mp.ParallelTransformerLayer: "parallel_transformer_layer",
    torch_mp.ParallelConvBlock: None,
    torch_mp.moe.MoE: "moe",
    torch_mp.dense.MoE: "moe",
}


def _constructor_options(cls) -> list[inspect.Parameter]:
    """The constructor's parameters, device and dtype aside."""
    parameters = inspect.signature(cls).parameters.values()
    return [p for p in parameters if p.name not in ("device", "dtype")]


def test_every_layer_module_is_one_the_core_declares():
    modules = {getattr(torch_mp.tensor_parallel, name) for name in torch_mp.tensor_parallel.__all__}
    layers = {m for m in modules if isinstance(m, type) and issubclass(m, nn.Module)}
    # A BatchNorm2d over this rank's channels: nn.BatchNorm2d's own options and a group.
    layers.discard(torch_mp.tensor_parallel.ChannelParallelBatchNorm2d)
    layers |= {torch_mp.moe.MoE, torch_mp.dense.MoE}
    assert layers == set(LAYERS)
    assert sorted(_C.declared_layers()) == sorted(cls._declaration.name for cls in LAYERS)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda cls: cls.__name__)
def test_the_constructor_takes_the_declared_options_in_order(cls):
    declared = _C.declared_options(cls._declaration.name)
    parameters = _constructor_options(cls)
    assert [p.name for p in parameters] == [name for name, *_ in declared]
    for p, (name, kind, _type, default) in zip(parameters, declared, strict=True):
        if kind == "required":
            assert p.default is inspect.Parameter.empty, name
        else:
            assert p.default == default, name
        expected = (
            inspect.Parameter.KEYWORD_ONLY
            if kind == "keyword"
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        assert p.kind == expected, name


@pytest.mark.parametrize(
    "cls", [cls for cls, op in LAYERS.items() if op], ids=lambda cls: cls.__name__
)
def test_the_constructor_takes_what_the_operator_schema_takes(cls):
    """The operator's keyword-only arguments are the module's options: the same names and
    defaults (a group by name, "" for None; the schema's "Any" holds no default)."""
    schema = getattr(torch.ops.torch_mp, LAYERS[cls]).default._schema
    keyword = [a for a in schema.arguments if a.kwarg_only]
    parameters = _constructor_options(cls)
    if cls is torch_mp.dense.MoE:  # the operator's group: "" for every expert on this process
        assert keyword[-1].name == "group" and keyword[-1].default_value == ""
        keyword = keyword[:-1]
    assert [a.name for a in keyword] == [p.name for p in parameters]
    groups = cls._declaration.groups
    for a, p in zip(keyword, parameters, strict=True):
        if p.default is inspect.Parameter.empty:
            assert not a.has_default_value(), a.name
        elif a.name in groups:
            assert p.default is None and a.default_value == "", a.name
        elif str(a.type) == "Any":
            assert not a.has_default_value(), a.name
        else:
            expected = list(p.default) if isinstance(p.default, tuple) else p.default
            assert a.default_value == expected, a.name


def test_an_option_the_core_does_not_declare_is_refused_by_name():
    with pytest.raises(TypeError, match="ParallelMLP has no option 'width'"):
        _C.check_options("ParallelMLP", {"hidden_size": 8, "ffn_hidden_size": 8, "width": 1})
    with pytest.raises(TypeError, match="ParallelMLP: missing the required option"):
        _C.check_options("ParallelMLP", {"hidden_size": 8})


def _construction_and_from_dense() -> dict[str, str]:
    mesh = use_mesh(dist.get_world_size())
    errors = {}
    for key, make in {
        "unknown": lambda: torch_mp.ColumnParallelLinear(8, 8, width=3),
        "missing": lambda: torch_mp.ParallelMLP(8),
        "positional": lambda: torch_mp.ParallelSelfAttention(8, 2, True, 0.0, False, None, True),
        "dense's": lambda: torch_mp.ParallelMLP.from_dense(torch_mp.dense.MLP(8, 8), bias=False),
        "from_dense unknown": lambda: torch_mp.ColumnParallelLinear.from_dense(
            nn.Linear(8, 8), width=3
        ),
    }.items():
        try:
            make()
        except TypeError as e:
            errors[key] = str(e)
    # What from_dense leaves to its caller reaches the layer, by position and by keyword.
    dense = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    layer = torch_mp.ParallelTransformerLayer.from_dense(dense, None, True, recompute="full")
    assert layer.sequence_parallel and layer.recompute == "full" and layer.hidden_size == 8
    assert layer.options()["ffn_hidden_size"] == 16 and layer.group is mesh.tp_group
    # Children take the options of the same name, and the ones named otherwise.
    assert layer.self_attn.recompute_core is False and layer.mlp.activation == "relu"
    assert layer.norm1.eps == dense.norm1.eps and layer.norm1.sequence_parallel
    return errors


def test_constructors_and_from_dense_take_exactly_the_declared_options(world2):
    for errors in world2.run(_construction_and_from_dense):
        assert (
            "ColumnParallelLinear: got an unexpected keyword argument 'width'" in errors["unknown"]
        )
        assert "ParallelMLP: missing a required argument: 'ffn_hidden_size'" in errors["missing"]
        assert "too many positional arguments" in errors["positional"]
        assert "'bias' is the dense module's" in errors["dense's"]
        assert "ColumnParallelLinear.from_dense: no option 'width'" in errors["from_dense unknown"]
