"""The C++ core's base (the files directly in csrc/torch_mp/) depends on nothing above it: no
area (tensor_parallel/, pipeline/, moe/, ...) is included from it, except by torch_mp.h, the
one header that includes them all for applications."""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "csrc" / "torch_mp"
INCLUDE = re.compile(r'^#include "torch_mp/([a-z_]+)/[^"]+"', re.MULTILINE)


def test_the_base_includes_no_area():
    base = sorted(p for p in CORE.iterdir() if p.suffix in (".h", ".cpp"))
    areas = {p.name for p in CORE.iterdir() if p.is_dir()}
    assert len(base) > 20 and {"tensor_parallel", "pipeline", "moe"} <= areas
    upward = [
        f"{path.name} includes {area}/"
        for path in base
        if path.name != "torch_mp.h"
        for area in INCLUDE.findall(path.read_text())
    ]
    assert not upward, "the base reaches up into an area:\n" + "\n".join(upward)


def test_the_sharded_state_arrow_runs_from_optim_to_data_parallel():
    # DataParallel makes the sharded state and the distributed optimizer is handed it
    # (data_parallel/owners.h): nothing in data_parallel/ may reach into optim/.
    data_parallel = sorted((CORE / "data_parallel").iterdir())
    assert len(data_parallel) > 10
    upward = [
        f"{path.name} includes {area}/"
        for path in data_parallel
        for area in INCLUDE.findall(path.read_text())
        if area == "optim"
    ]
    assert not upward, "data_parallel/ reaches into optim/:\n" + "\n".join(upward)
