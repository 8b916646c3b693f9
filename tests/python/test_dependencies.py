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
