"""A machine's figures for the step-time estimate (docs/plan.md, "Time"): one device's FLOP/s
and memory bandwidth, and what each rank sends per second within each dimension's group.

Give them by hand, load a machine file (``Machine.load("h100")``: the public figures of a DGX
node, with links inside and between nodes), or measure them on the current ranks
(``Machine.measure()``: a matmul, a copy and each group's all-reduce)."""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torch_mp import _C

__all__ = ["Machine", "parse_bytes"]

_FILES = pathlib.Path(__file__).parent / "machines"
#: The mesh's dimensions, fastest first (torch_mp.Mesh's rank order).
_ORDER = ("tp", "cp", "dp", "pp")
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
_UNITS.update({"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40})


def parse_bytes(size: str | float) -> int:
    """``"80GB"`` (powers of 1000; ``"80GiB"`` of 1024) or a number of bytes, as bytes."""
    if not isinstance(size, str):
        return int(size)
    text = size.strip()
    digits = text.rstrip("KMGTiB")
    unit = text[len(digits) :]
    if unit not in _UNITS or not digits:
        raise ValueError(
            f"plan: a size is a number of bytes or like '80GB' or '80GiB', got {size!r}"
        )
    return int(float(digits) * _UNITS[unit])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Machine:
    """One device and its links.

    Args:
        flops: FLOP/s one device's matmuls reach: one figure, or one per dtype
            (``{"bfloat16": 989e12, "float32": 67e12}``, names or torch dtypes).
        memory_bandwidth: GB/s of one device's memory (the elementwise work and the optimizer
            step are costed as its traffic).
        links: GB/s each rank sends within a dimension's group, by dimension (``"tp"``, ``"pp"``,
            ``"dp"``, ``"cp"``; ``"dp"`` is the data x context group's, which reduces the
            gradients); where a dimension of size > 1 is missing, ``intra_node`` or
            ``inter_node`` by where its group lies (below), else an error naming it.
        latency: Seconds of one message (each step of a ring).
        op_overhead: Seconds each operator takes beyond its work (dispatch, autograd, a
            kernel's launch).
        memory: Bytes of one device's memory (``"80GB"`` taken too), what the planner fits in.
        gpus_per_node, intra_node, inter_node: Devices per node and the GB/s a rank sends
            inside a node and to other nodes. A group whose ranks lie in one node (ranks are laid
            out tensor fastest, then context, data, pipeline) gets ``intra_node``.
        name: What it is, for tables.
    """

    flops: float | dict = 0.0
    memory_bandwidth: float = 0.0
    links: dict = field(default_factory=dict)
    latency: float = 0.0
    op_overhead: float = 0.0
    memory: int | str | None = None
    gpus_per_node: int | None = None
    intra_node: float | None = None
    inter_node: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.memory is not None:
            self.memory = parse_bytes(self.memory)
        if isinstance(self.flops, dict):
            self.flops = {
                k if isinstance(k, str) else _dtype_name(k): float(v) for k, v in self.flops.items()
            }

    @classmethod
    def load(cls, name: str | pathlib.Path) -> Machine:
        """A machine file: ``"h100"`` or ``"h200"`` (shipped, with their public figures), or the
        path of a JSON file of :class:`Machine`'s fields."""
        path = _FILES / f"{name}.json" if str(name) in cls.shipped() else pathlib.Path(name)
        if not path.is_file():
            raise FileNotFoundError(
                f"plan.Machine.load: no machine {str(name)!r}: give one of "
                f"{', '.join(cls.shipped())} or the path of a JSON file"
            )
        fields = json.loads(path.read_text())
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"plan.Machine.load: {path} has unknown fields {sorted(unknown)}")
        return cls(**fields)

    @staticmethod
    def shipped() -> list[str]:
        """The machine files that ship with torch_mp."""
        return sorted(p.stem for p in _FILES.glob("*.json"))

    def flops_at(self, dtype: torch.dtype) -> float:
        """FLOP/s at ``dtype``."""
        if not isinstance(self.flops, dict):
            return float(self.flops)
        name = _dtype_name(dtype)
        if name not in self.flops:
            raise ValueError(
                f"plan: the machine has no flops for {name} (it has {list(self.flops)})"
            )
        return self.flops[name]

    def link(self, dimension: str, sizes: dict[str, int]) -> float | None:
        """GB/s a rank sends within ``dimension``'s group of a mesh of ``sizes`` (None if not
        known: the core names it)."""
        if dimension in self.links:
            return float(self.links[dimension])
        if self.gpus_per_node is None:
            return None
        span = 1  # the ranks from the group's first to its last
        if dimension == "ep":  # ep consecutive ranks of a data x context group, tp apart
            span = sizes.get("tp", 1) * sizes.get("ep", 1)
        for d in _ORDER if dimension != "ep" else ():
            span *= sizes.get(d, 1)
            if d == dimension:
                break
        inside = span <= self.gpus_per_node and self.gpus_per_node % span == 0
        return self.intra_node if inside else self.inter_node

    def figures(self, dtype: torch.dtype, sizes: dict[str, int]) -> dict:
        """The core's plan::Machine (bytes/s) for a layout of ``sizes`` at ``dtype``."""
        links = {}
        group_sizes = {**sizes, "dp": sizes.get("dp", 1) * sizes.get("cp", 1)}  # (data x context)
        for d in ("tp", "cp", "pp", "dp", "ep"):
            rate = self.link(d, sizes) if group_sizes.get(d, 1) > 1 else None
            if rate is not None:
                links[d] = rate * 1e9
        return {
            "flops": self.flops_at(dtype),
            "memory_bandwidth": self.memory_bandwidth * 1e9,
            "links": links,
            "latency": float(self.latency),
            "op_overhead": float(self.op_overhead),
        }

    @classmethod
    def measure(
        cls, mesh=None, *, dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 9
    ) -> Machine:
        """The figures of the current ranks, from short probes run on all of them at once (so
        that ranks sharing a device or cores measure their share): a ``size`` x ``size`` matmul
        at ``dtype``, a chain of ten small operators forward and backward (each one's
        overhead), a copy of 32 MiB, and for each
        dimension of ``mesh`` (the default mesh when None) of size > 1 an all-reduce of 4 MiB
        (bandwidth) and of one element (latency). The fastest of ``repeats`` runs (what the
        device can do: interference only slows a run; the collectives' median), the slowest
        rank's. A collective over the whole world."""
        import torch_mp

        mesh = mesh if mesh is not None else torch_mp.get_mesh()
        device = torch.device("cuda", torch.cuda.current_device()) if _on_cuda(mesh) else None
        device = device or torch.device("cpu")

        def timed(run) -> float:
            run()  # (warm up)
            seconds = []
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                run()
                _sync(device)
                seconds.append(time.perf_counter() - start)
            return min(seconds)

        world = dist.group.WORLD.group_name
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        _C.barrier(world)
        flops = 2 * size**3 / timed(lambda: torch.mm(a, b))
        x = torch.ones(1, 64, device=device, requires_grad=True)

        def chain() -> None:  # 10 operators forward, about 20 backward
            y = x
            for _ in range(10):
                y = y * 1.0
            y.sum().backward()

        # (the step time counts a forward operator once and the backward's twice)
        overhead = timed(chain) / 30
        source = torch.empty(8 * 2**20, device=device)
        target = torch.empty_like(source)
        _C.barrier(world)
        bandwidth = 2 * source.nbytes / timed(lambda: target.copy_(source)) / 1e9
        links, latencies = {}, []
        big = 2**20  # float32 elements: 4 MiB
        groups = {
            "tp": (mesh.tp_group, mesh.tp_size),
            "cp": (mesh.cp_group, mesh.cp_size),
            "pp": (mesh.pp_group, mesh.pp_size),
            "dp": (mesh.dp_cp_group, mesh.dp_size * mesh.cp_size),  # (where gradients go)
        }
        for d, (group, p) in groups.items():
            if p == 1:
                continue
            _C.barrier(world)
            # (the core's probe: the median, as a collective waits for the slower rank in a step)
            seconds = _C.plan_time_all_reduce(big, group.group_name, repeats)
            latency = _C.plan_time_all_reduce(1, group.group_name, repeats) / (2 * (p - 1))
            sent = 2 * (p - 1) / p * big * 4  # bytes (per rank, by a ring)
            links[d] = sent / max(seconds - 2 * (p - 1) * latency, 1e-9) / 1e9
            latencies.append(latency)
        # the slowest rank's figures
        slowest = [-flops, -bandwidth, max(latencies, default=0.0), overhead]
        slowest += [-links[d] for d in sorted(links)]  # (every rank has each dimension)
        figures = torch.ops.torch_mp.all_reduce(
            torch.tensor(slowest, dtype=torch.float64, device=device), "max", world
        ).cpu()
        for i, d in enumerate(sorted(links)):
            links[d] = -figures[4 + i].item()
        return cls(
            flops={_dtype_name(dtype): -figures[0].item()},
            memory_bandwidth=-figures[1].item(),
            links=links,
            latency=figures[2].item(),
            op_overhead=figures[3].item(),
            name=f"measured on {dist.get_world_size()} {device.type} ranks",
        )


def _on_cuda(mesh) -> bool:
    backend = dist.get_backend(mesh.tp_group)
    return "nccl" in str(backend) and torch.cuda.is_available()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
