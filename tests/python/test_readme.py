"""The README's Python quick start, extracted from the README (not copied), runs as written
under torchrun and prints each data rank's loss."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_examples import _EXIT_RACE

ROOT = Path(__file__).resolve().parents[2]


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start: Python") :]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_the_python_quick_start_runs_as_written(tmp_path):
    code = _quick_start()
    assert "# torchrun --nproc-per-node=8 train.py" in code  # the launch it documents
    script = tmp_path / "train.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=8", str(script)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    result = launch()
    if result.returncode != 0 and _EXIT_RACE in result.stderr and "loss" in result.stdout:
        result = launch()  # (Gloo's exit race, as test_examples.py explains: once more)
    assert result.returncode == 0, result.stdout + result.stderr
    for dp_rank in (0, 1):
        assert f"data rank {dp_rank}: loss " in result.stdout, result.stdout
