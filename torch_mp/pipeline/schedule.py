"""Schedule generators and the simulator (both in the C++ core, csrc/torch_mp/pipeline)."""

from __future__ import annotations

import os

from torch_mp._C import pipeline as _core

Action = _core.Action
Schedule = _core.Schedule
SimulationResult = _core.SimulationResult
TimedAction = _core.TimedAction


def schedule_names() -> list[str]:
    """The names :func:`schedule` accepts."""
    return _core.schedule_names()


def default_stages_per_rank(name: str) -> int:
    """The stages each pipeline rank runs under the schedule ``name`` when nothing says
    otherwise: 2 for those that interleave (``"interleaved_1f1b"``, ``"interleaved_zb"``) or fold
    into a V (``"zbv"``), 1 for the others; what :class:`torch_mp.models.Trainer3D` builds and
    :func:`torch_mp.plan.estimate` counts. Raises :class:`torch_mp.LayoutError` on an unknown
    name."""
    return _core.default_stages_per_rank(name)


def schedule(
    name: str, num_stages: int, num_microbatches: int, stages_per_rank: int = 1
) -> Schedule:
    """Generates a pipeline schedule: every pipeline rank's ordered actions.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` (``stages_per_rank >= 2``,
            ``num_microbatches`` divisible by the number of ranks), ``"zb_h1"`` (zero bubble:
            backward split into input-gradient B and weight-gradient W, W filling the waits),
            ``"interleaved_zb"`` (the same over interleaved 1F1B) or ``"zbv"`` (zero-bubble V:
            two stages per rank, rank ``r`` holding ``r`` and ``2p - 1 - r``).
        num_stages: Total number of stages; there are ``num_stages // stages_per_rank`` pipeline
            ranks. Stage ``s`` lives on rank ``s % ranks`` except in ``"zbv"``'s V
            (``schedule.placement == "v"``); ``schedule.stages_of_rank(r)`` lists them.
        num_microbatches: Micro-batches per step.
        stages_per_rank: Stages (virtual stages) each rank holds.

    Returns:
        The :class:`Schedule`, sends and receives included. ``str(schedule)`` is its text form,
        which :func:`load_schedule` / ``Schedule.parse`` read back.

    Raises:
        RuntimeError: For an unknown name or sizes the schedule cannot take.
    """
    return _core.make_schedule(name, num_stages, num_microbatches, stages_per_rank)


def load_schedule(path_or_text: str | os.PathLike) -> Schedule:
    """Reads a schedule from a file (or from its text), e.g. one written by ``str(schedule)``
    and edited by hand. Check it with :func:`simulate` before running it."""
    text = str(path_or_text)
    if "\n" not in text and os.path.exists(text):
        with open(text) as f:
            text = f.read()
    return Schedule.parse(text)


def make_nccl_safe(schedule: Schedule) -> Schedule:
    """``schedule`` reordered where NCCL's rules would deadlock or misdeliver.

    Under ``simulate(..., comm_semantics="nccl")`` (tags ignored: messages between two ranks
    arrive in the order they are sent; a send completes only with its receive; a rank's
    operations to one peer run in order):

    - where a message would land in a receive meant for another (two ranks exchanging the
      messages of two stage boundaries, as ``"interleaved_zb"`` and ``"zbv"`` do), the receive
      it is meant for is posted just before;
    - while a replay gets stuck on a stream held by a lone send, that send moves past its
      rank's next computation, into the next group of sends and receives.

    Both moves are always valid (received data and sent tensors are kept until used). gpipe,
    1f1b, zb_h1 and interleaved_1f1b on 3 or more ranks pass unchanged. With unit costs the
    moved schedules keep their makespan on two ranks; on four, NCCL's in-order streams cost
    zbv 13 % and interleaved_zb 16 % at m = 4p (99 -> 112 and 115 units).

    Raises:
        RuntimeError: If a deadlock remains that no such move resolves.
    """
    return _core.make_nccl_safe(schedule)


def simulate(
    schedule: Schedule,
    forward: float = 1.0,
    backward: float = 2.0,
    weight: float | None = None,
    comm: float = 0.0,
    *,
    comm_semantics: str = "gloo",
) -> SimulationResult:
    """Replays ``schedule`` with a cost model, checking that it can run.

    Args:
        schedule: The schedule to replay.
        forward: Time of F.
        backward: Time of B (input gradient). A full backward BW costs ``backward + weight``;
            without ``weight``, ``backward`` is the whole backward (BW = backward, B = W = half).
        weight: Time of W (weight gradient).
        comm: Latency from a send to its receive.
        comm_semantics: How sends and receives behave. ``"gloo"``: a send is buffered, a receive
            waits for its message (matched by tag). ``"nccl"``: NCCL's rules, under which a
            schedule that Gloo runs may deadlock: a send completes only together with its
            receive, messages between two ranks are matched in order (tags ignored), and a
            rank's operations to one peer run in order; a rank's consecutive sends and receives
            are posted as one group (as the executor posts them, and as ``batch_isend_irecv``
            does). ``"nccl_ungrouped"``: the same, each operation posted on its own.

    Returns:
        A :class:`SimulationResult` with ``makespan``, ``bubble_fraction``, per-rank ``busy``
        and ``peak_live_microbatches``, and the ``timeline`` of every action.

    Raises:
        RuntimeError: Naming rank, step and action, if the schedule would deadlock, breaks a
            dependency, has a receive without a send (or the reverse), misses a computation, or
            (NCCL) would deliver a message into a receive meant for another.
    """
    return _core.simulate(schedule, forward, backward, weight, comm, comm_semantics)
