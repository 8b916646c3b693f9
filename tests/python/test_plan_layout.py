"""torch_mp.plan.Layout, a layout as one value (the C++ plan::Layout), which the keyword forms of
the planner's functions become in one place; and torch_mp.LayoutError, the refusal of a layout
the model cannot take, raised with the same words by the planner and by the runtime."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import use_mesh

import torch_mp
from torch_mp import plan
from torch_mp.models import DenseGPT, GPTConfig, Trainer3D, TrainingOptions
from torch_mp.plan.validation import CONFIG, MOE_CONFIG

SMALL = {"micro_batch": 2, "seq_len": 64}


def test_a_layout_is_one_value():
    layout = plan.Layout(tp=2, dp=4, zero=1, dtype=torch.bfloat16, micro_batch=1, seq_len=2048)
    text = "Layout(tp=2, dp=4, zero=1, dtype=torch.bfloat16, micro_batch=1, seq_len=2048)"
    assert repr(layout) == text
    assert repr(plan.Layout(**SMALL)) == "Layout(micro_batch=2, seq_len=64)"
    changed = layout.replace(zero=2, recompute="full")
    assert (changed.zero, changed.recompute, layout.zero, layout.recompute) == (2, "full", 1, None)
    assert layout.replace(zero=1) == layout and hash(layout.replace(zero=1)) == hash(layout)
    assert layout != layout.replace(tp=1) and layout != layout.keywords()
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert plan.Layout(**layout.keywords()) == layout
    assert (layout.master_dtype, layout.expert_load, layout.schedule) == (None, None, "1f1b")
    assert layout.replace(expert_load=1.5, master_dtype=torch.float32).expert_load == 1.5


def test_a_layout_refuses_what_it_cannot_be():
    with pytest.raises(TypeError):
        plan.Layout(micro_batch=1)  # (seq_len has no default)
    with pytest.raises(TypeError):
        plan.Layout(tensor_parallel=2, **SMALL)
    with pytest.raises(TypeError, match="floating-point"):
        plan.Layout(dtype=torch.int64, **SMALL)
    with pytest.raises(torch_mp.LayoutError, match="recompute must be None"):
        plan.Layout(recompute="most", **SMALL)
    with pytest.raises(TypeError, match="not both"):
        plan.estimate(CONFIG, plan.Layout(**SMALL), tp=2)
    with pytest.raises(TypeError, match="must be a torch_mp.plan.Layout"):
        plan.estimate(CONFIG, {"tp": 2, **SMALL})


@pytest.mark.parametrize(
    "keywords",
    [
        {},
        {"tp": 2, "dp": 2, "zero": 1, "sequence_parallel": True},
        {"pp": 2, "num_microbatches": 4, "schedule": "interleaved_1f1b", "recompute": "full"},
        {"pp": 2, "num_microbatches": 4, "schedule": "zbv"},
        {"dp": 4, "dtype": torch.bfloat16, "bucket_cap_mb": 1.0},
        {"cp": 2, "recompute": "selective", "optimizer": "sgd"},
    ],
)
def test_the_keyword_form_is_the_layout_form(keywords):
    by_keywords = plan.estimate(CONFIG, **SMALL, **keywords, machine="h100")
    by_layout = plan.estimate(CONFIG, plan.Layout(**SMALL, **keywords), machine="h100")
    assert str(by_keywords) == str(by_layout)
    assert by_keywords.time.seconds == by_layout.time.seconds
    assert by_keywords.bytes_sent == by_layout.bytes_sent


def test_moe_keywords_are_the_layout_form():
    keywords = {"dp": 2, "ep": 2, "expert_load": 1.25, **SMALL}
    a, b = plan.estimate(MOE_CONFIG, **keywords), plan.estimate(MOE_CONFIG, plan.Layout(**keywords))
    assert str(a) == str(b)


def test_a_schedule_enters_the_estimate_with_its_own_stages_per_rank():
    # plan/ names no schedule: the stages each rank runs come from the pipeline's own table, so
    # the estimate refuses ZeRO-2 exactly where that table gives two stages to a rank
    seen = set()
    for name in torch_mp.pipeline.schedule_names():
        per_rank = torch_mp.pipeline.default_stages_per_rank(name)
        seen.add(per_rank)
        layout = plan.Layout(pp=2, dp=2, num_microbatches=4, schedule=name, **SMALL)
        plan.estimate(CONFIG, layout)
        if per_rank == 1:
            plan.estimate(CONFIG, layout.replace(zero=2))
        else:
            with pytest.raises(torch_mp.LayoutError, match=f"two stages per rank \\({name}\\)"):
                plan.estimate(CONFIG, layout.replace(zero=2))
    assert seen == {1, 2}
    with pytest.raises(torch_mp.LayoutError, match="unknown schedule 'looped'"):
        torch_mp.pipeline.default_stages_per_rank("looped")


def test_layout_error_is_a_value_error_and_was_a_runtime_error():
    assert issubclass(torch_mp.LayoutError, ValueError)
    assert issubclass(torch_mp.LayoutError, RuntimeError)  # (what these refusals were before)
    assert plan.LayoutError is torch_mp.LayoutError


def _runtime_refusal(config: GPTConfig, ep: int) -> str | None:
    mesh = use_mesh(dist.get_world_size() // ep, ep=ep)
    torch.manual_seed(0)
    try:
        Trainer3D(DenseGPT(config), mesh, TrainingOptions())
    except torch_mp.LayoutError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "config, sizes",
    [
        (GPTConfig(vocab=32, seq=16, hidden=24, heads=3, ffn=48, layers=2), {"tp": 2}),
        (
            GPTConfig(vocab=32, seq=16, hidden=16, heads=2, ffn=32, layers=2, moe_experts=3),
            {"dp": 2, "ep": 2},
        ),
    ],
    ids=["heads by tp", "experts by ep"],
)
def test_the_runtime_and_the_planner_refuse_a_layout_in_the_same_words(world2, config, sizes):
    with pytest.raises(torch_mp.LayoutError) as planned:
        plan.estimate(config, micro_batch=1, seq_len=16, **sizes)
    for refusal in world2.run(_runtime_refusal, config, sizes.get("ep", 1)):
        assert refusal == str(planned.value)


def _operators(config: GPTConfig, tp: int, ep: int, sp: bool) -> dict[str, int]:
    """What the GPT's parts that Trainer3D trains (a GPTStage) dispatch in a forward and the loss,
    as the estimate's table counts them: a layer, the embeddings, the head and the loss."""
    from torch_mp._memory import PeakMemory
    from torch_mp.models import GPTStage

    use_mesh(tp, ep=ep)
    ids = torch.randint(config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(0))

    def count(layers: int, last: bool) -> int:
        torch.manual_seed(0)
        dense = DenseGPT(GPTConfig(**{**vars(config), "layers": layers}))
        stage = GPTStage(dense, range(layers), first=True, last=last, sequence_parallel=sp)
        with PeakMemory() as memory:
            out = stage(ids)
            if last:
                stage.loss(*(out if isinstance(out, tuple) else (out,)), ids)
        return memory.operators

    one, two, first = count(1, True), count(2, True), count(1, False)
    layer = two - one
    return {"layer": layer, "embeddings": first - layer, "head_and_loss": one - first}


DENSE = GPTConfig(vocab=32, seq=16, hidden=16, heads=2, ffn=32, layers=1)
MOE = GPTConfig(vocab=32, seq=16, hidden=16, heads=2, ffn=32, layers=1, moe_experts=4)


@pytest.mark.parametrize(
    "ranks, config, tp, ep, sp",
    [
        (1, DENSE, 1, 1, False),
        (2, DENSE, 2, 1, False),
        (2, DENSE, 2, 1, True),
        (1, MOE, 1, 1, False),
        (2, MOE, 1, 2, False),
        (2, MOE, 2, 1, False),
        (4, MOE, 2, 2, False),
    ],
    ids=["dense", "dense tp", "dense tp sp", "moe", "moe ep", "moe tp", "moe tp ep"],
)
def test_the_operator_table_is_what_the_layers_dispatch(ranks, config, tp, ep, sp):
    from torch_mp import _C

    table = _C.plan_gpt_operators(tp > 1, sp, config.moe_experts > 0, ep > 1)
    for counted in get_world(ranks).run(_operators, config, tp, ep, sp):
        assert counted == table
