"""torch_mp.init: the mesh's groups follow rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) *
tp + tp_rank ((pp_rank * dp + dp_rank) * tp + tp_rank without context parallelism)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from reference import error_of, use_mesh

import torch_mp


def _members(group: dist.ProcessGroup) -> list[int]:
    """World ranks of ``group``, in group-rank order, found by communicating over it."""
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def _layout(tp: int, pp: int) -> dict:
    mesh = use_mesh(tp, pp)
    return {
        "sizes": (mesh.tp_size, mesh.pp_size, mesh.dp_size),
        "ranks": (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank),
        "tp": _members(mesh.tp_group),
        "dp": _members(mesh.dp_group),
        "pp": _members(mesh.pp_group),
        "default_is_this": torch_mp.get_mesh() is mesh,
    }


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_groups_follow_tensor_then_data_then_pipeline(world4, tp, pp):
    dp = 4 // (tp * pp)
    for rank, got in enumerate(world4.run(_layout, tp, pp)):
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        assert got["sizes"] == (tp, pp, dp)
        assert got["ranks"] == (tp_rank, pp_rank, dp_rank)

        def at(p, d, t):
            return (p * dp + d) * tp + t

        assert got["tp"] == [at(pp_rank, dp_rank, i) for i in range(tp)]
        assert got["dp"] == [at(pp_rank, i, tp_rank) for i in range(dp)]
        assert got["pp"] == [at(i, dp_rank, tp_rank) for i in range(pp)]
        assert got["default_is_this"]


def _layout_with_context(tp: int, pp: int, cp: int) -> dict:
    mesh = use_mesh(tp, pp, cp)
    return {
        "sizes": (mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.cp_size),
        "ranks": (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank, mesh.cp_rank),
        "tp": _members(mesh.tp_group),
        "cp": _members(mesh.cp_group),
        "dp": _members(mesh.dp_group),
        "pp": _members(mesh.pp_group),
        "dp_cp": _members(mesh.dp_cp_group),
    }


@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)])
def test_context_groups_sit_between_tensor_and_data(world4, tp, pp, cp):
    dp = 4 // (tp * pp * cp)
    for rank, got in enumerate(world4.run(_layout_with_context, tp, pp, cp)):
        t, c = rank % tp, (rank // tp) % cp
        d, p = (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
        assert got["sizes"] == (tp, pp, dp, cp)
        assert got["ranks"] == (t, p, d, c)

        def at(p, d, c, t):
            return ((p * dp + d) * cp + c) * tp + t

        assert got["tp"] == [at(p, d, c, i) for i in range(tp)]
        assert got["cp"] == [at(p, d, i, t) for i in range(cp)]
        assert got["dp"] == [at(p, i, c, t) for i in range(dp)]
        assert got["pp"] == [at(i, d, c, t) for i in range(pp)]
        assert got["dp_cp"] == [at(p, i, j, t) for i in range(dp) for j in range(cp)]


def _layout_with_experts(tp: int, pp: int, cp: int, ep: int) -> dict:
    mesh = use_mesh(tp, pp, cp, ep)
    return {
        "ep": (mesh.ep_size, mesh.ep_rank),
        "ep_group": _members(mesh.ep_group),
        "expert_dp": _members(mesh.expert_dp_group),
        "dp_cp": _members(mesh.dp_cp_group),
    }


@pytest.mark.parametrize(
    "tp,pp,cp,ep", [(1, 1, 1, 2), (1, 1, 1, 4), (2, 1, 1, 2), (1, 1, 2, 2), (1, 2, 1, 2)]
)
def test_expert_groups_are_blocks_of_the_data_context_ranks(world4, tp, pp, cp, ep):
    for rank, got in enumerate(world4.run(_layout_with_experts, tp, pp, cp, ep)):
        data_context = got["dp_cp"]  # data rank major, context rank minor
        place = data_context.index(rank)
        assert got["ep"] == (ep, place % ep)
        first = place - place % ep
        assert got["ep_group"] == data_context[first : first + ep]
        assert got["expert_dp"] == data_context[place % ep :: ep]


def _bad_init(kwargs: dict) -> str | None:
    return error_of(torch_mp.init, **kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tp": 3}, "world size 4 is not divisible by tp * pp = 3 * 1"),
        ({"tp": 2, "dp": 3}, "world size 4 is not tp * pp * dp = 2 * 1 * 3"),
        ({"tp": 0}, "tp and pp must be positive"),
        ({"cp": 3}, "world size 4 is not divisible by tp * pp * cp = 1 * 1 * 3"),
        ({"cp": 0}, "cp must be positive"),
        ({"ep": 3}, "ep (3) must divide dp (4)"),
        ({"tp": 2, "ep": 4}, "ep (4) must divide dp (2)"),
        ({"cp": 2, "ep": 3}, "ep (3) must divide dp * cp (4)"),
        ({"ep": 0}, "ep (0) must divide"),
    ],
)
def test_a_world_size_that_does_not_factor_raises(world4, kwargs, message):
    for got in world4.run(_bad_init, kwargs):
        assert got is not None and message in got


def _init_differs_between_ranks(tp_of_rank_0: int) -> str | None:
    return error_of(torch_mp.init, tp=tp_of_rank_0 if dist.get_rank() == 0 else 1)


@pytest.mark.parametrize("tp_of_rank_0", [2, 3], ids=["valid-everywhere", "invalid-on-rank-0"])
def test_init_arguments_that_differ_between_ranks_raise_on_every_rank(world2, tp_of_rank_0):
    for got in world2.run(_init_differs_between_ranks, tp_of_rank_0):
        assert got is not None
        assert "torch_mp.init arguments [tp, pp, dp] must be the same on every rank" in got


# ---- without torchrun -------------------------------------------------------------------------

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
_WITHOUT_TORCHRUN = """
import torch, torch_mp
mesh = torch_mp.init({args})
print("sizes", mesh.tp_size, mesh.pp_size, mesh.dp_size, torch.distributed.get_world_size())
"""


def _run_without_torchrun(args: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_WITHOUT_TORCHRUN.format(args=args))
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )


def test_without_torchrun_a_mesh_of_one_runs_as_a_world_of_one(tmp_path):
    result = _run_without_torchrun("", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sizes 1 1 1 1" in result.stdout
    assert "not launched by torchrun" in result.stderr and "torchrun --nproc-per-node=N" in (
        result.stderr
    )


@pytest.mark.parametrize("args, needed", [("tp=2", 2), ("tp=2, pp=2", 4), ("dp=2, cp=2", 4)])
def test_without_torchrun_a_larger_mesh_says_how_to_launch_it(args, needed, tmp_path):
    result = _run_without_torchrun(args, tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: torch_mp.init"), result.stderr
    assert f"torchrun --nproc-per-node={needed} train.py" in last, last
