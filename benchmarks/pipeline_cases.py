"""The schedules the pipeline benchmarks compare: torch_mp's name beside the
torch.distributed.pipelining class that runs the same schedule.

torch.distributed.pipelining has no ZB-H1 class: its ``ScheduleInterleavedZeroBubble`` with one
stage per rank is the ZB1P (= ZB-H1) schedule of the zero-bubble paper.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import pipelining as torch_pipelining


@dataclass(frozen=True)
class Case:
    """One schedule, by its torch_mp name and its torch.distributed.pipelining class."""

    name: str
    stages_per_rank: int
    torch_class: type


CASES = [
    Case("gpipe", 1, torch_pipelining.ScheduleGPipe),
    Case("1f1b", 1, torch_pipelining.Schedule1F1B),
    Case("interleaved_1f1b", 2, torch_pipelining.ScheduleInterleaved1F1B),
    Case("zb_h1", 1, torch_pipelining.ScheduleInterleavedZeroBubble),
]
