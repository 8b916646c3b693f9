"""The schedules the pipeline benchmarks compare: torch_mp's name beside the
torch.distributed.pipelining class that runs the same schedule.

torch.distributed.pipelining has no ZB-H1 class: its ``ScheduleInterleavedZeroBubble`` with one
stage per rank is the ZB1P (= ZB-H1) schedule of the zero-bubble paper, and with two stages per
rank the interleaved zero-bubble schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import pipelining as torch_pipelining

from torch_mp import pipeline


@dataclass(frozen=True)
class Case:
    """One schedule, by its torch_mp name and its torch.distributed.pipelining class."""

    name: str
    stages_per_rank: int
    torch_class: type

    def schedule(self, num_ranks: int, num_microbatches: int) -> pipeline.Schedule:
        """torch_mp's schedule for ``num_ranks`` ranks."""
        return pipeline.schedule(
            self.name, num_ranks * self.stages_per_rank, num_microbatches, self.stages_per_rank
        )


CASES = [
    Case("gpipe", 1, torch_pipelining.ScheduleGPipe),
    Case("1f1b", 1, torch_pipelining.Schedule1F1B),
    Case("interleaved_1f1b", 2, torch_pipelining.ScheduleInterleaved1F1B),
    Case("zb_h1", 1, torch_pipelining.ScheduleInterleavedZeroBubble),
    Case("interleaved_zb", 2, torch_pipelining.ScheduleInterleavedZeroBubble),
    Case("zbv", 2, torch_pipelining.ScheduleZBVZeroBubble),
]


def ends_on_rank(schedule: pipeline.Schedule, rank: int) -> tuple[bool, bool]:
    """Whether ``rank`` holds the first stage (takes the batch) and the last (takes the
    target); zbv's V puts both on rank 0."""
    return (
        schedule.rank_of_stage(0) == rank,
        schedule.rank_of_stage(schedule.num_stages - 1) == rank,
    )
