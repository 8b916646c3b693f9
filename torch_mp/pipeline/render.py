"""Timeline pictures and Chrome traces of a schedule, simulated or measured.

Both take a :class:`~torch_mp.pipeline.Schedule` (simulated with default costs), a
:class:`~torch_mp.pipeline.SimulationResult`, or any trace with the same ``timeline`` (records
with ``rank``, ``action`` (``kind``, ``stage``, ``microbatch``), ``start`` and ``end``), such as
one measured during a real run.
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch_mp.pipeline.schedule import Schedule, simulate

# One colour per compute kind; stages of one rank (interleaved schedules) alternate in shade.
_COLOURS = {
    "F": ("#4c78a8", "#9ecae9"),
    "B": ("#54a24b", "#88d27a"),
    "BW": ("#54a24b", "#88d27a"),
    "W": ("#f58518", "#ffbf79"),
}


def _timeline(schedule_or_trace: Any) -> list:
    if isinstance(schedule_or_trace, Schedule):
        schedule_or_trace = simulate(schedule_or_trace)
    return list(schedule_or_trace.timeline)


def render(schedule_or_trace: Any, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Writes a timeline picture: ranks as rows, compute actions as coloured boxes labelled
    with their micro-batch, idle time (bubbles) left blank.

    Args:
        schedule_or_trace: A schedule, a simulation result or a measured trace.
        path: Output file; ``.svg`` or ``.png`` (by extension).
        title: Caption; the schedule's name and bubble fraction when available.

    Raises:
        ValueError: For another extension.
        ImportError: If matplotlib is not installed.
    """
    path = os.fspath(path)
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".svg", ".png"):
        raise ValueError(f"render: cannot write '{path}': use a .svg or .png file name")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if title is None and isinstance(schedule_or_trace, Schedule):
        result = simulate(schedule_or_trace)
        title = f"{schedule_or_trace.name}: bubble {result.bubble_fraction:.1%}"
    timeline = [t for t in _timeline(schedule_or_trace) if t.action.is_compute]
    ranks = 1 + max(t.rank for t in timeline)
    makespan = max(t.end for t in timeline)
    figure, axes = plt.subplots(figsize=(max(6.0, min(40.0, makespan * 0.35)), 0.5 * ranks + 1.2))
    for t in timeline:
        a = t.action
        colour = _COLOURS[a.kind][(a.stage // ranks) % 2]
        axes.barh(
            t.rank,
            t.end - t.start,
            left=t.start,
            height=0.8,
            color=colour,
            edgecolor="white",
            linewidth=0.5,
        )
        label = str(a.microbatch) if a.kind != "W" else f"{a.microbatch}w"
        axes.text(
            (t.start + t.end) / 2,
            t.rank,
            label,
            ha="center",
            va="center",
            fontsize=7,
            color="black",
        )
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.invert_yaxis()
    axes.set_xlim(0, makespan)
    axes.set_xlabel("time")
    axes.set_facecolor("#f2f2f2")  # bubbles show as grey
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLOURS[k][0]) for k in ("F", "BW", "W")]
    axes.legend(
        handles,
        ["forward", "backward (B / BW)", "weight grad (W)"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    if title:
        axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def chrome_trace(schedule_or_trace: Any, path: str | os.PathLike) -> None:
    """Writes the timeline as Chrome trace JSON (open in Perfetto or chrome://tracing).

    Each rank is a thread of one process; times are taken as seconds (simulated costs are
    unitless, so one unit shows as one second). Sends and receives appear as instant events.
    """
    events: list[dict] = []
    ranks = set()
    for t in _timeline(schedule_or_trace):
        a = t.action
        ranks.add(t.rank)
        event = {
            "name": str(a),
            "cat": a.kind,
            "pid": 0,
            "tid": t.rank,
            "ts": t.start * 1e6,
            "args": {"stage": a.stage, "microbatch": a.microbatch},
        }
        if a.is_compute:
            event.update(ph="X", dur=(t.end - t.start) * 1e6)
        else:
            event.update(ph="i", s="t")
        events.append(event)
    for rank in sorted(ranks):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"pipeline rank {rank}"},
            }
        )
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
