"""The Python example, launched for real with torchrun, agrees with its one-process reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_mlp_example_under_torchrun(nproc):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(ROOT / "examples/python/tp_mlp.py"),
            "--steps",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tensor-parallel MLP on {nproc} rank(s)" in result.stdout
    assert "step 3: loss" in result.stdout
    assert "agreement with the one-process reference" in result.stdout and ": OK" in result.stdout
