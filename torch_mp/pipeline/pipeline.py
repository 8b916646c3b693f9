"""``Pipeline``: runs this rank's stages under a schedule (the executor is the C++ core's)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch_mp._C import pipeline as _core
from torch_mp.data_parallel import stage_hooks
from torch_mp.mesh import Mesh, get_mesh
from torch_mp.pipeline.schedule import Schedule


def _as_list(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _call_loss(loss_fn, outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    if loss_fn is None:
        raise RuntimeError("Pipeline: the last stage needs a loss_fn")
    return loss_fn(*outputs, *targets)


def _present(values) -> list[torch.Tensor]:
    """The tensors given, flattening tuples; None (a rank without that stage) gives nothing."""
    return [t for v in values if v is not None for t in _as_list(v)]


class Pipeline:
    """Pipeline-parallel training of this rank's stage(s).

    Every rank of the pipeline group builds a ``Pipeline`` with its own stage modules and calls
    :meth:`step` together: the rank holding the first stage passes the batch, the rank holding
    the last stage passes ``target=``, the others pass nothing. After :meth:`step` every
    parameter's ``.grad`` equals that of the unpipelined model with the loss averaged over the
    whole batch (each micro-batch's loss is divided by ``num_microbatches``).

    Args:
        stage_modules: This rank's stage, or its stages in increasing order for schedules with
            several stages per rank: ``schedule.stages_of_rank(r)`` (stages ``r, r + p, ...``
            of ``p`` ranks, or ``r`` and ``2p - 1 - r`` for ``"zbv"``, whose V puts the first
            and the last stage on rank 0). A stage
            takes and returns a tensor or a tuple of tensors. A stage wrapped in
            :class:`torch_mp.DataParallel` or ``DistributedDataParallel`` (over
            ``mesh.dp_group``) has its gradients averaged over the data group once per step,
            right after its last backward, for every schedule.
        schedule: A schedule name (see :func:`torch_mp.pipeline.schedule_names`) or a
            :class:`~torch_mp.pipeline.Schedule`.
        num_microbatches: Micro-batches per step; the batch size must be divisible by it.
        loss_fn: ``loss_fn(output, target)`` on the last stage, averaged over the micro-batch
            (e.g. ``nn.functional.mse_loss``).
        mesh: Uses ``mesh.pp_group``; ``group`` instead gives the pipeline group directly; the
            default mesh's when neither is given.
        tied_parameters: Parameters of the first stage tied to as many of the last stage (the
            input embedding and the output head): the ranks holding the first and the last stage
            each pass theirs, in the same order; others pass none. The last stage's copies start
            from the first stage's values, their gradients are summed over
            ``mesh.embedding_group`` after every step (so both copies stay equal under any
            optimizer), and norms count them once. With one pipeline rank, share the parameter
            itself instead.
        check_finite: Check every stage output, loss and input gradient for NaN and Inf as it
            is made; the first one raises, naming the stage, micro-batch, action and tensor.
            Costs a reduction per tensor, so it is off by default.

    When a step fails on one rank (a stage, the loss or a backward raises, a peer dies or
    stalls), every rank's :meth:`step` raises, naming the rank, stage, micro-batch and action
    where it began and the original error: the failing rank sends a failure notice in place of
    every message it still owed, so its peers raise at once and pass it on, and the ranks
    agree at the end of every step (one all-reduce of a scalar), so that even a rank which had
    finished learns of it. A peer that stalls is named at the group's timeout, a dead one as
    soon as its connection closes. Then call :meth:`reset` on every rank and go on.

    Raises:
        RuntimeError: If the schedule cannot run (it is simulated first), does not fit the group
            or the number of stage modules, or differs between ranks.
    """

    def __init__(
        self,
        stage_modules: nn.Module | Sequence[nn.Module],
        schedule: str | Schedule = "1f1b",
        num_microbatches: int | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        mesh: Mesh | None = None,
        group: dist.ProcessGroup | None = None,
        tied_parameters: Sequence[torch.Tensor] = (),
        check_finite: bool = False,
    ) -> None:
        modules = [stage_modules] if isinstance(stage_modules, nn.Module) else list(stage_modules)
        if mesh is not None and group is not None:
            raise ValueError("Pipeline: pass mesh= or group=, not both")
        if group is None:
            mesh = mesh or get_mesh()
            group = mesh.pp_group
        if isinstance(schedule, str) and num_microbatches is None:
            raise ValueError("Pipeline: num_microbatches is required with a schedule name")
        given = None if isinstance(schedule, str) else schedule.num_microbatches
        if given is not None and num_microbatches not in (None, given):
            raise ValueError(
                f"Pipeline: num_microbatches={num_microbatches} contradicts the schedule's {given}"
            )
        self.modules = modules
        self.loss_fn = loss_fn
        self.group = group
        stages = []
        for module in modules:
            forward, arm = stage_hooks(module)
            stages.append(
                _core.Stage(
                    lambda inputs, forward=forward: _as_list(forward(*inputs)),
                    list(module.parameters()),
                    arm,
                )
            )
        # The C++ object must not refer back to self: Python's collector cannot see that cycle.
        loss = functools.partial(_call_loss, loss_fn)
        if isinstance(schedule, str):
            self._core = _core.Pipeline(stages, loss, schedule, num_microbatches, group.group_name)
        else:
            self._core = _core.Pipeline(stages, loss, schedule, group.group_name)
        self._core.set_check_finite(check_finite)
        if tied_parameters or (mesh is not None and mesh.embedding_group is not None):
            embedding_group = mesh.embedding_group if mesh is not None else None
            self._core.tie_parameters(
                list(tied_parameters), embedding_group.group_name if embedding_group else ""
            )

    def reset(self) -> None:
        """Makes the pipeline usable again after a step that failed on any rank; call it on
        every rank of the pipeline group, whether its own step raised or not.

        A timeout or a lost connection leaves Gloo's connections closed, and under NCCL's rules
        (:attr:`ordered`) a failed step may leave messages queued between two ranks, so the
        pipeline moves to a fresh group of the same ranks and backend (made over the default
        store, without the other ranks of the job). Messages of the failed step are never taken
        for the next one, which is exact. A dead process cannot come back this way: restart the
        job (e.g. torchrun's ``--max-restarts``) and resume from a checkpoint.
        """
        ranks = dist.get_process_group_ranks(self.group)
        store = dist.distributed_c10d._get_default_store()
        self._core.reset(store, "ranks_" + "_".join(str(r) for r in ranks))

    @property
    def schedule(self) -> Schedule:
        """The schedule this pipeline runs (made NCCL-safe when :attr:`ordered`)."""
        return self._core.schedule

    @property
    def ordered(self) -> bool:
        """Whether the pipeline runs under NCCL's rules: on an NCCL group, or on any group when
        the collective checks were on at construction (``TORCH_MP_CHECK_COLLECTIVES=1``, or
        :func:`torch_mp.functional.set_check_collectives`), so that a Gloo run does what an NCCL
        run would. Then the schedule is made NCCL-safe
        (:func:`~torch_mp.pipeline.make_nccl_safe`) and proved to run under NCCL's semantics, each
        run of consecutive sends and receives is posted as one group, and every message between
        two ranks has the same tag, matched in the order sent."""
        return self._core.ordered

    @property
    def trace(self):
        """This rank's actions in the last step with their wall-clock times in seconds: pass it
        to :func:`torch_mp.pipeline.render` or :func:`~torch_mp.pipeline.chrome_trace`."""
        return _Trace(self._core.trace)

    def gathered_trace(self):
        """Every pipeline rank's :attr:`trace` of the last step, as one trace, on the pipeline
        group's first rank (None on the others): a collective over the pipeline group. Each
        rank's times count from its own start of the step."""
        gathered = self._core.gathered_trace()
        return None if gathered is None else _Trace(gathered)

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None):
        """Runs forward and backward over all micro-batches, accumulating gradients.

        Returns:
            The mean micro-batch loss (a detached scalar) on the rank holding the last stage,
            None elsewhere.
        """
        return self._core.step(_present(inputs), _present([target]))

    def eval_step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None):
        """Runs forward only (no autograd).

        Returns:
            On the rank holding the last stage: the output (micro-batches concatenated), or
            ``(output, mean loss)`` when ``target`` is given. None elsewhere.
        """
        outputs, loss = self._core.eval_step(_present(inputs), _present([target]))
        if not outputs:
            return None
        output = outputs[0] if len(outputs) == 1 else tuple(outputs)
        return output if loss is None else (output, loss)


class _Trace:
    """A measured timeline, in the form render and chrome_trace read."""

    def __init__(self, timeline) -> None:
        self.timeline = timeline
