"""torch_mp.plan.estimate against what the ranks allocate (torch_mp.plan.measure): every layout
of torch_mp.plan.validation.LAYOUTS at 1, 2 and 4 ranks, the peak within 5 % and what stays
between steps (parameters, gradients, optimizer state, ZeRO's staging) within 2 %; the
estimate's structure (rows, micro-batches in flight from the schedule) and its errors."""

from __future__ import annotations

import pytest
import torch
from reference import use_mesh

from torch_mp import plan
from torch_mp.models import DenseGPT, GPTConfig
from torch_mp.plan.validation import (
    CONFIG,
    LAYOUTS,
    MOE_CONFIG,
    PEAK_BOUND,
    STATES_BOUND,
    compare,
    mesh_key,
    out_of_bounds,
)

SMALL = {"micro_batch": 2, "seq_len": 64}


def _validate(world_size: int, start: int, stop: int) -> list[str]:
    layouts = LAYOUTS[world_size][start:stop]
    meshes = {key: use_mesh(*key) for key in map(mesh_key, layouts)}
    rows = compare(layouts, meshes)
    return [
        f"{r.layout} ({r.kind}): peak {100 * r.peak_error:+.2f} %, "
        f"between steps {100 * r.states_error:+.3f} %"
        for r in rows
        if abs(r.peak_error) > PEAK_BOUND or abs(r.states_error) > STATES_BOUND
    ]


def test_the_estimate_is_within_its_bounds_of_what_the_ranks_allocate(world):
    layouts, chunk = len(LAYOUTS[world.size]), 6  # (each run well within the workers' deadline)
    failures = []
    for start in range(0, layouts, chunk):
        failures += world.run(_validate, world.size, start, start + chunk)[0]
    assert not failures, "\n".join(failures)


def test_there_are_at_least_twelve_layouts_covering_every_setting():
    layouts = [layout for size in (2, 4) for layout in LAYOUTS[size]]
    assert len(layouts) >= 12
    seen = {key: {layout.get(key) for layout in layouts} for key in ("zero", "recompute")}
    assert {None, 1, 2, 3} <= seen["zero"] and {None, "selective", "full"} <= seen["recompute"]
    assert any(layout.get("dtype") == torch.bfloat16 for layout in layouts)
    for key in ("tp", "pp", "dp", "cp", "ep"):
        assert any(layout.get(key, 1) > 1 for layout in layouts), key


def test_rows_name_each_kind_of_rank():
    assert [r.kind for r in plan.estimate(CONFIG, **SMALL).ranks] == ["every rank"]
    rows = plan.estimate(CONFIG, pp=4, num_microbatches=8, **SMALL).ranks
    assert [r.kind for r in rows] == [
        "first stage",
        "pipeline rank 1",
        "pipeline rank 2",
        "last stage",
    ]
    assert [r.pipeline_ranks for r in rows] == [[0], [1], [2], [3]]
    wide = GPTConfig(vocab=65, seq=64, hidden=64, heads=4, ffn=256, layers=8)
    rows = plan.estimate(wide, pp=4, schedule="gpipe", num_microbatches=4, **SMALL).ranks
    assert [(r.kind, r.pipeline_ranks) for r in rows] == [
        ("first stage", [0]),
        ("middle stages", [1, 2]),
        ("last stage", [3]),
    ]


def test_micro_batches_in_flight_come_from_the_schedule():
    def in_flight(schedule: str, m: int = 8) -> list[int]:
        rows = plan.estimate(CONFIG, pp=4, schedule=schedule, num_microbatches=m, **SMALL).ranks
        return [r.microbatches_in_flight for r in rows for _ in r.pipeline_ranks]

    assert in_flight("gpipe") == [8, 8, 8, 8]
    assert in_flight("1f1b") == [4, 3, 2, 1]
    gpipe = plan.estimate(CONFIG, pp=2, schedule="gpipe", num_microbatches=4, **SMALL).ranks[0]
    one_f_one_b = plan.estimate(CONFIG, pp=2, num_microbatches=4, **SMALL).ranks[0]
    assert gpipe.activations > one_f_one_b.activations
    assert gpipe.between_steps == one_f_one_b.between_steps


def test_the_parts_add_up_and_zero_shrinks_the_states():
    states = []
    for zero in range(4):
        (row,) = plan.estimate(CONFIG, dp=4, zero=zero, **SMALL).ranks
        assert row.between_steps == (
            row.parameters + row.gradients + row.optimizer_state + row.persistent_buffers
        )
        assert row.peak >= row.between_steps + row.activations
        states.append(row.parameters + row.gradients + row.optimizer_state)
    assert states[0] > states[1] > states[2] > states[3]
    params = sum(p.numel() for p in DenseGPT(CONFIG).parameters())
    assert states[0] == 16 * params  # fp32 parameters and gradients, AdamW's two moments


def test_a_meta_model_is_estimated_from_its_config():
    with torch.device("meta"):
        model = DenseGPT(CONFIG)
    assert (
        plan.estimate(model, **SMALL).ranks[0].peak == plan.estimate(CONFIG, **SMALL).ranks[0].peak
    )


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"tp": 3}, "num_heads \\(4\\) must be divisible by the tensor-parallel size \\(3\\)"),
        ({"pp": 3}, "4 layers cannot be cut into 3 equal stages"),
        ({"ep": 2}, "needs MoE layers"),
        ({"cp": 3}, "divisible by 2 \\* cp"),
        ({"zero": 3, "pp": 2}, "ZeRO-3"),
        ({"zero": 2, "pp": 2, "schedule": "interleaved_1f1b", "num_microbatches": 4}, "ZeRO-2"),
        ({"schedule": "looped"}, "unknown schedule 'looped'"),
        ({"optimizer": "lion"}, "optimizer must be"),
        ({"recompute": "most"}, "recompute must be"),
        ({"seq_len": 65}, "exceeds the model's 64 positions"),
        ({"tp": 2, "sequence_parallel": True, "seq_len": 63}, "sequence parallelism"),
    ],
)
def test_a_layout_the_model_cannot_take_is_refused_by_name(keywords, message):
    with pytest.raises(ValueError, match=message):
        plan.estimate(CONFIG, **{**SMALL, **keywords})


@pytest.mark.parametrize(
    "keywords, message",
    [
        (
            {"ep": 3, "dp": 3},
            "num_experts \\(4\\) must be divisible by the expert-parallel size \\(3\\)",
        ),
        ({"ep": 2}, "ep=2 must divide dp x cp=1"),
        ({"ep": 2, "dp": 2, "zero": 1}, "zero must be 0"),
        ({"ep": 2, "dp": 2, "dtype": torch.bfloat16}, "no fp32 masters"),
        ({"recompute": "full"}, "no recomputation"),
        ({"tp": 2, "sequence_parallel": True}, "no sequence parallelism"),
        ({"ep": 2, "dp": 2, "expert_load": 0.5}, "expert_load"),
    ],
)
def test_a_moe_layout_the_trainer_cannot_run_is_refused_by_name(keywords, message):
    with pytest.raises(ValueError, match=message):
        plan.estimate(MOE_CONFIG, **{**SMALL, **keywords})


def test_experts_split_over_the_expert_group():
    whole = plan.estimate(MOE_CONFIG, dp=4, **SMALL)
    split = plan.estimate(MOE_CONFIG, dp=4, ep=4, **SMALL)
    params = sum(p.numel() for p in DenseGPT(MOE_CONFIG).parameters())
    assert whole.ranks[0].between_steps == 16 * params
    experts = 4 * 2 * 4 * 256 * 64  # layers x (fc1, fc2) x experts x ffn x hidden
    assert split.ranks[0].between_steps == 16 * (params - experts * 3 // 4)
    assert whole.bytes_sent["ep"] == 0 < split.bytes_sent["ep"]
    # the experts' gradients are all-reduced over the ranks holding the same experts: none here
    assert split.bytes_sent["dp"] < whole.bytes_sent["dp"]
    # the busiest rank's load: the default above the balanced share, a given one as given
    balanced = plan.estimate(MOE_CONFIG, dp=4, ep=4, expert_load=1.0, **SMALL).ranks[0]
    busier = plan.estimate(MOE_CONFIG, dp=4, ep=4, expert_load=1.3, **SMALL).ranks[0]
    assert balanced.activations < split.ranks[0].activations < busier.activations
    assert balanced.between_steps == busier.between_steps


def test_other_models_are_refused_clearly():
    with pytest.raises(TypeError, match="must be a torch_mp.models.GPTConfig .* got dict"):
        plan.estimate({"hidden": 64}, **SMALL)


# A small Hugging Face Llama (grouped key and value heads, an untied head) and Mixtral (4 experts,
# 2 per token), traced on fake tensors and trained as examples/python/llama.py trains them, held
# to the GPT's bounds: the peak within 5 %, what stays between steps within 2 % (measured: the
# peak within -0.8 to +3.1 %).
DECODER_LAYOUTS = {
    1: [{}, {"recompute": "full"}, {"dtype": torch.bfloat16}, {"model": "mixtral"}],
    2: [
        {"dp": 2, "zero": 2},
        {"dp": 2, "zero": 3, "dtype": torch.bfloat16},
        {"tp": 2},
        {"tp": 2, "recompute": "full"},
        {"model": "mixtral", "dp": 2, "ep": 2},
        {"model": "mixtral", "tp": 2, "dtype": torch.bfloat16},
    ],
    4: [
        {"tp": 2, "dp": 2, "zero": 1},
        {"tp": 2, "dp": 2, "zero": 3},
        {"model": "mixtral", "tp": 2, "dp": 2, "ep": 2},
    ],
}


def _decoders():
    import transformers

    sizes = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return {
        "llama": transformers.LlamaConfig(**sizes),
        "mixtral": transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2),
    }


def _validate_decoder(world_size: int) -> list[str]:
    configs = _decoders()
    failures = []
    for layout in DECODER_LAYOUTS[world_size]:
        layout = dict(layout)
        config = configs[layout.pop("model", "llama")]
        mesh = use_mesh(layout.get("tp", 1), ep=layout.get("ep", 1))
        keywords = {**SMALL, **layout}
        failures.append(out_of_bounds(config, config, mesh, keywords, config.model_type))
    return [f for f in failures if f]


def test_a_hugging_face_decoder_is_estimated_from_its_trace(world):
    failures = [f for rank in world.run(_validate_decoder, world.size) for f in rank]
    assert not failures, "\n".join(failures)


def test_a_model_not_estimated_is_refused_by_its_type():
    import transformers

    with pytest.raises(TypeError, match="model_type 'gpt2': not estimated yet"):
        plan.estimate(transformers.GPT2Config(), **SMALL)


def test_a_mixtral_layout_the_trainer_cannot_run_is_refused_by_name():
    mixtral = _decoders()["mixtral"]
    with pytest.raises(ValueError, match="num_local_experts \\(4\\) is not divisible by ep=3"):
        plan.estimate(mixtral, dp=3, ep=3, **SMALL)
    with pytest.raises(ValueError, match="no recomputation"):
        plan.estimate(mixtral, recompute="full", **SMALL)
