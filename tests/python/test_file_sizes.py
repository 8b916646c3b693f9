"""No source file over 500 lines in csrc, torch_mp, examples, benchmarks or tests: one idea per
file (issue 36)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500
FOLDERS = ("csrc", "torch_mp", "examples", "benchmarks", "tests")
SUFFIXES = {".py", ".cpp", ".h", ".cu", ".cuh"}


def test_no_source_file_is_over_500_lines():
    tracked = subprocess.run(
        ["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    lengths = {
        name: len((ROOT / name).read_text().splitlines())
        for name in tracked
        if Path(name).suffix in SUFFIXES and (ROOT / name).exists()
    }
    assert lengths, "no source files found: is this a git checkout?"
    over = {name: n for name, n in lengths.items() if n > LIMIT}
    assert not over, f"over {LIMIT} lines: {over}"
