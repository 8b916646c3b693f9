"""The step-time estimate against measured steps: does ``plan.estimate(..., machine=...)`` rank
layouts as they really run?

Run on two ranks (one thread each, as torchrun sets it)::

    .venv/bin/torchrun --standalone --nproc-per-node=2 benchmarks/plan_time.py

The machine is measured first (``plan.Machine.measure``: a matmul, a copy, each group's
all-reduce, on both ranks at once). Then every layout below of one GPT (hidden 256, 4 heads,
ffn 1024, 4 layers, vocabulary 512, sequences of 128; matmuls dominate) trains the same global
batch of 16 sequences per step (``plan.measure_time``: the median of the timed steps, barrier to
barrier) and is estimated on that machine. Printed: a table of measured and estimated seconds,
the Spearman rank correlation of the two, and the worst absolute error. docs/plan.md ("Time")
shows a run.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

import torch_mp
from torch_mp import plan
from torch_mp.models import GPTConfig
from torch_mp.plan.validation import describe

CONFIG = GPTConfig(vocab=512, seq=128, hidden=256, heads=4, ffn=1024, layers=4)
GLOBAL_BATCH = 16  # sequences per step
_FULL = {"recompute": "full"}
#: Layouts of two ranks (estimate's keywords; the micro-batch is what keeps the global batch).
LAYOUTS = [
    {"dp": 2, "num_microbatches": 1},
    {"dp": 2, "zero": 1, "num_microbatches": 1},
    {"dp": 2, "zero": 3, "num_microbatches": 2},
    {"dp": 2, "num_microbatches": 8},
    {"dp": 2, **_FULL, "num_microbatches": 1},
    {"dp": 2, **_FULL, "num_microbatches": 8},
    {"tp": 2, "num_microbatches": 1},
    {"tp": 2, "sequence_parallel": True, "num_microbatches": 2},
    {"tp": 2, **_FULL, "num_microbatches": 4},
    {"pp": 2, "num_microbatches": 1},
    {"pp": 2, **_FULL, "num_microbatches": 1},
    {"pp": 2, "num_microbatches": 2},
    {"pp": 2, "num_microbatches": 8},
    {"pp": 2, "num_microbatches": 4, "schedule": "gpipe"},
    {"pp": 2, "num_microbatches": 4, "schedule": "interleaved_1f1b"},
]


def ranks_of(values: list[float]) -> list[float]:
    """Each value's rank (1 = smallest; ties share their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """The rank correlation of ``a`` and ``b`` (Pearson's of their ranks)."""
    ra, rb = ranks_of(a), ranks_of(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    meshes = {(1, 1): torch_mp.init(timeout=120)}
    world = dist.get_world_size()
    machine = plan.Machine.measure(meshes[(1, 1)])
    for tp, pp in [(world, 1), (1, world)]:
        mesh = meshes.setdefault((tp, pp), torch_mp.init(tp=tp, pp=pp, timeout=120))
        machine.links.update(plan.Machine.measure(mesh).links)
    rows = []
    for layout in LAYOUTS:
        dp = layout.get("dp", 1)
        micro_batch = GLOBAL_BATCH // (dp * layout["num_microbatches"])
        keywords = {"micro_batch": micro_batch, "seq_len": CONFIG.seq, **layout}
        key = (layout.get("tp", 1), layout.get("pp", 1))
        if key not in meshes:
            meshes[key] = torch_mp.init(tp=key[0], pp=key[1], timeout=120)
        measured = plan.measure_time(CONFIG, mesh=meshes[key], steps=args.steps, **keywords)
        estimated = plan.estimate(CONFIG, machine=machine, **keywords).time
        rows.append((describe(keywords), measured, estimated))
    if dist.get_rank() != 0:
        return
    print(f"machine: {machine}\n")
    print("| layout | measured s | estimated s | error | bubble (est.) | dp exposed (est.) |")
    print("|---|--:|--:|--:|--:|--:|")
    for name, measured, t in rows:
        error = t.seconds / measured - 1
        print(
            f"| {name} | {measured:.3f} | {t.seconds:.3f} | {100 * error:+.0f} % | "
            f"{t.bubble_fraction:.2f} | {t.data_parallel:.3f} |"
        )
    measured = [m for _, m, _ in rows]
    estimated = [t.seconds for _, _, t in rows]
    worst = max(rows, key=lambda r: abs(r[2].seconds - r[1]))
    print(f"\nSpearman {spearman(measured, estimated):.3f} over {len(rows)} layouts")
    print(
        f"worst absolute error {worst[2].seconds - worst[1]:+.3f} s "
        f"({100 * (worst[2].seconds / worst[1] - 1):+.0f} %, {worst[0]})"
    )


if __name__ == "__main__":
    main()
