"""Pipeline parallelism: schedules as data, their simulator, and pictures of them.

::

    from torch_mp import pipeline
    s = pipeline.schedule("1f1b", num_stages=4, num_microbatches=8)
    print(s)                                   # one line of actions per pipeline rank
    r = pipeline.simulate(s, forward=1.0, backward=2.0)
    r.bubble_fraction                          # (p - 1) / (m + p - 1) = 3 / 11
    pipeline.render(r, "1f1b.svg")             # timeline picture (.svg or .png)
    pipeline.chrome_trace(r, "1f1b.json")      # for Perfetto / chrome://tracing
"""

from torch_mp.pipeline.partition import partition
from torch_mp.pipeline.pipeline import Pipeline
from torch_mp.pipeline.render import chrome_trace, render
from torch_mp.pipeline.schedule import (
    Action,
    Schedule,
    SimulationResult,
    TimedAction,
    default_stages_per_rank,
    load_schedule,
    make_nccl_safe,
    schedule,
    schedule_names,
    simulate,
)
from torch_mp.pipeline.split_backward import WeightWork, backward_input, backward_weight
from torch_mp.pipeline.traced import TracedStage, traced_stage

__all__ = [
    "Pipeline",
    "Action",
    "Schedule",
    "SimulationResult",
    "TimedAction",
    "TracedStage",
    "WeightWork",
    "backward_input",
    "backward_weight",
    "chrome_trace",
    "default_stages_per_rank",
    "load_schedule",
    "make_nccl_safe",
    "partition",
    "render",
    "schedule",
    "schedule_names",
    "simulate",
    "traced_stage",
]
