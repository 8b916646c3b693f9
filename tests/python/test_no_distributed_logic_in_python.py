"""Python holds no distributed logic: no module of torch_mp calls a torch.distributed collective,
point-to-point operation or group constructor, except the mesh's set-up (torch_mp/mesh.py, which
makes the process groups). Every exchange goes through the C++ core (torch_mp._C and the
torch.ops.torch_mp operators)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torch_mp"

# What communicates, or makes a group: torch.distributed's collectives and point-to-point
# operations (their object forms included), and its group constructors.
COMMUNICATING = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "all_gather_coalesced", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
    "init_process_group",
}  # fmt: skip
# A c10d ProcessGroup's own methods that communicate (called on a group object, not through
# torch.distributed): any call of these names is one, but the core's (torch_mp._C.barrier).
GROUP_METHODS = {
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "reduce_scatter",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "alltoall", "alltoall_base",
    "broadcast", "send", "recv", "recv_anysource", "barrier", "monitoredBarrier",
}  # fmt: skip
# The mesh's set-up makes the world and its groups.
ALLOWED = {"mesh.py": {"init_process_group", "new_group"}}
# Modules whose functions communicate under other names.
FORBIDDEN_MODULES = ("torch.distributed._functional_collectives", "torch.distributed.nn")


def _distributed_calls(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each call of a communicating torch.distributed function in ``path``,
    and of each import of one (or of a module of them)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"torch.distributed"}  # dotted names that stand for torch.distributed
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name == "torch.distributed" and name.asname:
                    aliases.add(name.asname)
                if name.name.startswith(FORBIDDEN_MODULES):
                    found.append((node.lineno, name.name))
        elif isinstance(node, ast.ImportFrom) and node.module:
            for name in node.names:
                full = f"{node.module}.{name.name}"
                if node.module == "torch" and name.name == "distributed":
                    aliases.add(name.asname or "distributed")
                elif node.module.startswith("torch.distributed") and name.name in COMMUNICATING:
                    found.append((node.lineno, name.name))
                elif full.startswith(FORBIDDEN_MODULES) or node.module.startswith(
                    FORBIDDEN_MODULES
                ):
                    found.append((node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, ast.unparse(node.func.value)
            owner = owner.removesuffix(".distributed_c10d")
            if name in COMMUNICATING and owner in aliases:
                found.append((node.lineno, name))
            elif name in GROUP_METHODS and owner not in aliases and owner != "_C":
                found.append((node.lineno, f"{owner}.{name}"))
    return found


def test_no_module_of_torch_mp_communicates_outside_the_mesh_set_up():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, "the package's modules were not found"
    outside, allowed_seen = [], set()
    for path in files:
        allowed = ALLOWED.get(str(path.relative_to(PACKAGE)), set())
        for line, name in _distributed_calls(path):
            if name in allowed:
                allowed_seen.add(name)
            else:
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not outside, "torch.distributed called from Python; call the core instead:\n" + (
        "\n".join(outside)
    )
    # (The scan sees calls: the mesh's own are found.)
    assert allowed_seen == {"init_process_group", "new_group"}


def test_the_scan_finds_each_form_of_a_call(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "import torch.distributed as dist\n"
        "from torch import distributed as d2\n"
        "import torch\n"
        "from torch.distributed import all_gather_object\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "dist.all_reduce(x)\n"
        "d2.barrier()\n"
        "torch.distributed.broadcast(x, 0)\n"
        "dist.distributed_c10d.all_gather(parts, x)\n"
        "group.allreduce([x]).wait()\n"
        "_C.barrier(name)\n"
        "dist.get_rank()\n"
    )
    found = sorted(name for _, name in _distributed_calls(source))
    assert found == sorted(
        [
            "all_gather_object",
            "torch.distributed._functional_collectives",
            "all_reduce",
            "barrier",
            "broadcast",
            "all_gather",
            "group.allreduce",
        ]
    )
