"""The data x pipeline x tensor (x context, expert) process-group mesh (rank arithmetic in the
C++ core)."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_mp import _C

_default_mesh: Mesh | None = None


@dataclass(frozen=True)
class Mesh:
    """This rank's process groups along the axes of the mesh.

    Ranks are laid out tensor fastest, then context, then data, then pipeline:
    ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``, so a tensor group, then
    a context group, sits inside one node (``(pp_rank * dp + dp_rank) * tp + tp_rank`` when
    cp = 1).

    Attributes:
        tp_group: The tensor-parallel group (an ordinary ``torch.distributed`` group).
        pp_group: The pipeline-parallel group.
        dp_group: The data-parallel group.
        tp_size, pp_size, dp_size: The sizes of the three axes.
        embedding_group: The ranks of the first and last pipeline stages with this rank's data,
            context and tensor coordinates, where a tied embedding/head is summed
            (:meth:`torch_mp.pipeline.Pipeline` ``tied_parameters``); None on the ranks of the
            stages in between.
        cp_group, cp_size: The context-parallel group (ranks that split each sequence between
            them, :mod:`torch_mp.context_parallel`) and its size; a group of one rank when
            cp = 1 (None in a Mesh built by hand).
        dp_cp_group: The data x context ranks of this rank's pipeline and tensor coordinates,
            over which the gradients of parameters replicated over the context group are
            reduced; the data group when cp = 1.
        ep_group, ep_size: The expert-parallel group (ranks that split a mixture of experts'
            experts between them, :mod:`torch_mp.moe`): ``ep`` consecutive ranks of the data x
            context group, and its size; a group of one rank when ep = 1 (None in a Mesh built
            by hand).
        expert_dp_group: The ranks holding the same experts as this one (the same place in
            every expert group of the data x context group), over which expert gradients are
            reduced; the data x context group when ep = 1.
    """

    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_size: int
    pp_size: int
    dp_size: int
    embedding_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    cp_size: int = 1
    dp_cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    ep_size: int = 1
    expert_dp_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.dp_cp_group is None:
            object.__setattr__(self, "dp_cp_group", self.dp_group)
        if self.expert_dp_group is None:
            object.__setattr__(self, "expert_dp_group", self.dp_cp_group)

    def __repr__(self) -> str:
        cp = f", cp={self.cp_size}" if self.cp_size > 1 else ""
        cp_rank = f", cp_rank={self.cp_rank}" if self.cp_size > 1 else ""
        if self.ep_size > 1:
            cp += f", ep={self.ep_size}"
            cp_rank += f", ep_rank={self.ep_rank}"
        return (
            f"Mesh(tp={self.tp_size}, pp={self.pp_size}, dp={self.dp_size}{cp}; "
            f"tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, dp_rank={self.dp_rank}{cp_rank})"
        )

    @property
    def cp_rank(self) -> int:
        """This process's rank in its context-parallel group (0 without one)."""
        return 0 if self.cp_group is None else dist.get_rank(self.cp_group)

    @property
    def ep_rank(self) -> int:
        """This process's rank in its expert-parallel group (0 without one)."""
        return 0 if self.ep_group is None else dist.get_rank(self.ep_group)

    @property
    def tp_rank(self) -> int:
        """This process's rank in its tensor-parallel group."""
        return dist.get_rank(self.tp_group)

    @property
    def pp_rank(self) -> int:
        """This process's rank in its pipeline-parallel group (its stage)."""
        return dist.get_rank(self.pp_group)

    @property
    def dp_rank(self) -> int:
        """This process's rank in its data-parallel group."""
        return dist.get_rank(self.dp_group)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launched_by_torchrun() -> bool:
    """Whether any of the variables torchrun sets is set (all of them are needed then: torch
    names a missing one)."""
    return any(name in os.environ for name in _TORCHRUN_VARIABLES)


def _init_a_world_of_one(backend: str, timeout: datetime.timedelta | None, needed: int) -> None:
    """``python train.py`` without torchrun: a world of one process if that is all the mesh
    asks for (said on stderr), else an error that says how to launch it."""
    if needed > 1:
        raise RuntimeError(
            f"torch_mp.init: this mesh needs at least {needed} processes, and none of "
            f"{', '.join(_TORCHRUN_VARIABLES)} is set: launch the script with torchrun, e.g. "
            f"`torchrun --nproc-per-node={needed} {_script()}`"
        )
    print(
        "torch_mp.init: not launched by torchrun (no RANK or WORLD_SIZE): running as a world "
        f"of one process; `torchrun --nproc-per-node=N {_script()}` runs N",
        file=sys.stderr,
    )
    options = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(
        backend=backend, store=dist.HashStore(), rank=0, world_size=1, **options
    )


def _script() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"


def _elastic_store(timeout: datetime.timedelta | None) -> dict:
    """Under torchrun's agent, the rendezvous of this launch attempt: the agent's store with a
    prefix of the attempt. (torch's own env:// rendezvous leaves the keys of an earlier attempt
    visible to Gloo, so after ``torchrun --max-restarts`` restarts the workers, they connect to
    addresses of the dead attempt and fail.) Elsewhere, nothing: torch's env:// as it is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"/torch_mp/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": world_size,
    }


def init(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    backend: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    cp: int = 1,
    ep: int = 1,
) -> Mesh:
    """Builds the tensor, pipeline and data groups and makes them the default mesh.

    Initialises ``torch.distributed`` from the torchrun environment (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) unless a default group already exists, which is
    then used as it is. Every rank must call ``init`` with the same arguments. Without torchrun
    (``python train.py``), a mesh of one process runs as a world of one (said on stderr), and
    a larger one raises, saying how to launch it.

    Args:
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        dp: Data-parallel size; ``world_size // (tp * pp * cp)`` when None.
        backend: ``"nccl"`` or ``"gloo"``; NCCL when CUDA is available, Gloo otherwise.
        timeout: Timeout of every collective on the new groups (a ``timedelta`` or seconds), so
            that a dead peer raises instead of hanging; torch's default when None.
        cp: Context-parallel size: ranks that split each sequence between them
            (:mod:`torch_mp.context_parallel`).
        ep: Expert-parallel size: ranks that split a mixture of experts' experts between them
            (:mod:`torch_mp.moe`); divides ``dp * cp``.

    Returns:
        The new default :class:`Mesh`.

    Raises:
        RuntimeError: If the world size is not ``tp * pp * dp * cp``, ``ep`` does not divide
            ``dp * cp``, or ranks passed different arguments; without torchrun, if the mesh
            needs more than one process.
    """
    global _default_mesh
    timeout = _as_timedelta(timeout)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if backend == "nccl" and local_rank < torch.cuda.device_count():
            torch.cuda.set_device(local_rank)
        if not _launched_by_torchrun():
            _init_a_world_of_one(backend, timeout, tp * pp * max(cp * (dp or 1), ep))
        else:
            dist.init_process_group(backend=backend, timeout=timeout, **_elastic_store(timeout))
    world = dist.group.WORLD
    # Agree on the request before acting on it, so that ranks that asked for different meshes
    # all raise instead of waiting for groups the others never create.
    _C.check_same_across_ranks(
        [tp, pp, -1 if dp is None else dp], world.group_name, "torch_mp.init arguments [tp, pp, dp]"
    )
    _C.check_same_across_ranks([cp], world.group_name, "torch_mp.init argument cp")
    _C.check_same_across_ranks([ep], world.group_name, "torch_mp.init argument ep")
    tp, pp, dp = _C.mesh_shape(dist.get_world_size(), tp, pp, dp, cp, ep)
    rank = dist.get_rank()
    mine = {}
    # new_group must be called by every rank for every group, in the same order.
    for axis, groups in _C.mesh_groups(tp, pp, dp, cp, ep).items():
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                mine[axis] = group
    _default_mesh = Mesh(
        tp_group=mine["tp"],
        pp_group=mine["pp"],
        dp_group=mine["dp"],
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        embedding_group=mine.get("embedding"),
        cp_group=mine["cp"],
        cp_size=cp,
        dp_cp_group=mine.get("dp_cp"),
        ep_group=mine["ep"],
        ep_size=ep,
        expert_dp_group=mine.get("expert_dp"),
    )
    return _default_mesh


def get_mesh() -> Mesh:
    """Returns the default mesh made by :func:`init`.

    Raises:
        RuntimeError: If :func:`init` has not been called.
    """
    if _default_mesh is None:
        raise RuntimeError("torch_mp: there is no default mesh; call torch_mp.init() first")
    return _default_mesh


def find_mesh() -> Mesh | None:
    """The default mesh, or None if there is none (the C++ core's ``find_mesh``)."""
    return _default_mesh


def set_mesh(mesh: Mesh | None) -> None:
    """Makes ``mesh`` the default mesh (None clears it)."""
    global _default_mesh
    _default_mesh = mesh


def tp_group_or_default(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the default mesh's tensor-parallel group when None (the top-level
    convenience of the layers and collectives; the C++ core's ``tp_group_or_default``)."""
    return group if group is not None else get_mesh().tp_group


def tp_group_name(group: dist.ProcessGroup | None) -> str:
    """The registry name of ``group``, or of the default mesh's tensor group when None.

    The C++ core looks groups up by this name (see csrc/python/bindings.cpp).
    """
    return tp_group_or_default(group).group_name
