"""The estimate against what the ranks allocate: a matrix of layouts of a small GPT, each trained
for three steps (:func:`torch_mp.plan.measure`) and estimated (:func:`torch_mp.plan.estimate`).
The tests hold every row within :data:`PEAK_BOUND` of the measured peak and
:data:`STATES_BOUND` of what stays between steps; docs/plan.md shows the table, printed by

    torchrun --standalone --nproc-per-node=2 -m torch_mp.plan.validation   (and 4)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

import torch_mp
from torch_mp import _C
from torch_mp.models import GPTConfig
from torch_mp.plan import estimate, measure

__all__ = [
    "CONFIG",
    "LAYOUTS",
    "MOE_CONFIG",
    "PEAK_BOUND",
    "STATES_BOUND",
    "Row",
    "compare",
    "out_of_bounds",
    "table",
]

#: The model the layouts train: 4 layers, small enough for 4 ranks on 2 cores.
CONFIG = GPTConfig(vocab=65, seq=64, hidden=64, heads=4, ffn=256, layers=4)
#: The layouts with ``"model": "moe"`` train it with a mixture of 4 experts (2 per token) for
#: each MLP.
MOE_CONFIG = dataclasses.replace(CONFIG, moe_experts=4, moe_top_k=2)
_MODELS = {"gpt": CONFIG, "moe": MOE_CONFIG}
PEAK_BOUND = 0.05
STATES_BOUND = 0.02

_BF16 = {"dtype": torch.bfloat16}
_MOE = {"model": "moe"}
#: Layouts by world size (each dict: estimate's keywords, micro_batch 2 and seq_len 64 unless
#: given; and ``"model": "moe"`` for :data:`MOE_CONFIG`).
LAYOUTS: dict[int, list[dict]] = {
    1: [{}, {"recompute": "full"}, {"num_microbatches": 4}, {**_MOE, "num_microbatches": 2}],
    2: [
        {"dp": 2},
        {"dp": 2, "zero": 1},
        {"dp": 2, "zero": 2, "num_microbatches": 4},
        {"dp": 2, "zero": 3},
        {"dp": 2, **_BF16, "num_microbatches": 2},
        {"tp": 2},
        {"tp": 2, "sequence_parallel": True},
        {"tp": 2, "recompute": "selective"},
        {"tp": 2, "sequence_parallel": True, "recompute": "full"},
        {"pp": 2, "num_microbatches": 4},
        {"pp": 2, "num_microbatches": 4, "schedule": "gpipe"},
        {"pp": 2, "num_microbatches": 4, "schedule": "interleaved_1f1b"},
        {"pp": 2, "num_microbatches": 4, "schedule": "zb_h1"},
        {"dp": 2, "micro_batch": 1, "seq_len": 32},
        {"cp": 2},
        {"cp": 2, "zero": 2, "recompute": "full", "num_microbatches": 2},
        {**_MOE, "dp": 2, "ep": 2},
        {**_MOE, "tp": 2, **_BF16},
        {**_MOE, "pp": 2, "num_microbatches": 4, "schedule": "zb_h1"},
    ],
    4: [
        {"cp": 2, "dp": 2, "zero": 1},
        {"tp": 2, "cp": 2, "sequence_parallel": True},
        {"tp": 2, "pp": 2, "num_microbatches": 4},
        {"tp": 2, "dp": 2, "zero": 2, "sequence_parallel": True},
        {"dp": 4, "zero": 3},
        {"pp": 2, "dp": 2, **_BF16, "num_microbatches": 2},
        {"pp": 4, "num_microbatches": 8},
        {
            "pp": 2,
            "dp": 2,
            "zero": 1,
            "recompute": "full",
            "schedule": "interleaved_1f1b",
            "num_microbatches": 4,
        },
        {
            "tp": 2,
            "pp": 2,
            "sequence_parallel": True,
            "recompute": "selective",
            "schedule": "zb_h1",
            "num_microbatches": 4,
        },
        {"tp": 4},
        {"tp": 2, "dp": 2, **_BF16, "recompute": "selective"},
        {**_MOE, "dp": 4, "ep": 4},
        {**_MOE, "tp": 2, "dp": 2, "ep": 2},
        {**_MOE, "pp": 2, "dp": 2, "ep": 2, "num_microbatches": 4},
    ],
}


@dataclass(frozen=True)
class Row:
    """One kind of rank of one layout: the most any of its ranks allocated, and the estimate."""

    layout: str
    kind: str
    measured_peak: int
    estimated_peak: int
    measured_states: int
    estimated_states: int

    @property
    def peak_error(self) -> float:
        return self.estimated_peak / self.measured_peak - 1

    @property
    def states_error(self) -> float:
        return self.estimated_states / self.measured_states - 1


def describe(layout: dict) -> str:
    """``layout`` in estimate's keywords, defaults left out."""
    parts = []
    for key, value in layout.items():
        if key == "model":
            parts.append("MoE" if value == "moe" else value)
            continue
        if key == "dtype":
            value = str(value).removeprefix("torch.")
        parts.append(f"{key}={value}")
    return ", ".join(parts) or "one rank"


def mesh_key(layout: dict) -> tuple[int, int, int, int]:
    """The (tp, pp, cp, ep) of ``layout``'s mesh."""
    return tuple(layout.get(d, 1) for d in ("tp", "pp", "cp", "ep"))


def compare(layouts: list[dict], meshes: dict | None = None) -> list[Row]:
    """Measures and estimates every layout on the current ranks (a collective: every rank calls
    it with the same layouts; their sizes' product must be the world size). ``meshes`` caches the
    meshes by (tp, pp, cp, ep) between calls. Returns the rows, the same on every rank."""
    meshes = {} if meshes is None else meshes
    rows: list[Row] = []
    for layout in layouts:
        keywords = {"micro_batch": 2, "seq_len": 64, **layout}
        config = _MODELS[keywords.pop("model", "gpt")]
        key = mesh_key(keywords)
        if key not in meshes:
            meshes[key] = torch_mp.init(tp=key[0], pp=key[1], cp=key[2], ep=key[3], timeout=60)
        everyone = _every_rank(measure(config, mesh=meshes[key], **keywords))
        for row in estimate(config, **keywords).ranks:
            ranks = [m for m in everyone if m["pipeline_rank"] in row.pipeline_ranks]
            rows.append(
                Row(
                    describe(layout),
                    row.kind,
                    max(m["peak"] for m in ranks),
                    row.peak,
                    max(m["states"] for m in ranks),
                    row.between_steps,
                )
            )
    return rows


def _every_rank(mine: dict[str, int]) -> list[dict[str, int]]:
    """Every rank's measurement (its ``peak``, ``states`` and ``pipeline_rank``), by the core's
    all-gather over the world."""
    keys = ("peak", "states", "pipeline_rank")
    world = dist.group.WORLD.group_name
    row = torch.tensor([[mine[k] for k in keys]], dtype=torch.int64, device=_C.device_of(world))
    everyone = torch.ops.torch_mp.all_gather(row, 0, world)
    return [dict(zip(keys, values, strict=True)) for values in everyone.tolist()]


def out_of_bounds(measured, estimated, mesh, layout: dict, name: str) -> str | None:
    """``measured`` trained at ``layout`` on ``mesh`` (:func:`torch_mp.plan.measure`, a
    collective) against the estimate of ``estimated`` (the same model, e.g. its config or built
    on the meta device) at a layout of one kind of rank (pp 1), both at the busiest rank: None
    within :data:`PEAK_BOUND` and :data:`STATES_BOUND`, else what is off, named ``name``."""
    everyone = _every_rank(measure(measured, mesh=mesh, **layout))
    peak, states = max(m["peak"] for m in everyone), max(m["states"] for m in everyone)
    row = estimate(estimated, **layout).ranks[0]
    peak_error, states_error = row.peak / peak - 1, row.between_steps / states - 1
    if abs(peak_error) <= PEAK_BOUND and abs(states_error) <= STATES_BOUND:
        return None
    return (
        f"{name} {layout}: peak {100 * peak_error:+.2f} %, between steps "
        f"{100 * states_error:+.3f} %"
    )


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (bytes in KiB)."""
    lines = [
        "| layout | ranks | peak measured | estimated | error | between steps measured "
        "| estimated | error |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layout} | {r.kind} | {r.measured_peak / 1024:,.0f} | "
            f"{r.estimated_peak / 1024:,.0f} | {100 * r.peak_error:+.1f} % | "
            f"{r.measured_states / 1024:,.0f} | {r.estimated_states / 1024:,.0f} | "
            f"{100 * r.states_error:+.2f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    meshes = {(1, 1, 1, 1): torch_mp.init(timeout=60)}  # the world, from torchrun
    rows = compare(LAYOUTS[dist.get_world_size()], meshes)
    if dist.get_rank() == 0:
        print(table(rows))
        worst = max(rows, key=lambda r: abs(r.peak_error))
        print(f"\nworst peak error {100 * worst.peak_error:+.2f} % ({worst.layout}, {worst.kind})")


if __name__ == "__main__":
    main()
