"""Malformed safetensors files (safetensors_corpus.py: every case of the format's rules, every
truncation, every wrong type, nesting 100,000 deep) get the safetensors package's verdict from
each of torch_mp's readers, read in processes of their own: the Python front end
(``checkpoint.load_file``), the C++ front end (``torch_mp::checkpoint::load_file``) and a 2-rank
``checkpoint.load`` of a checkpoint holding the file. A refusal is a RuntimeError naming the
file; no reader crashes or hangs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import get_world
from reference import error_of, use_mesh
from safetensors_corpus import UNSTABLE_TEXT, reference_verdict, write_corpus
from test_untrusted_checkpoints import record_checksums

from torch_mp import checkpoint

ROOT = Path(__file__).resolve().parents[2]
READ_FILES = ROOT / os.environ.get("TORCH_MP_BUILD", "build") / "tests/cpp/read_files"

# Reads each file given, a line each, flushed before the next (so that a crash names its file).
PYTHON_READER = """
import sys
from torch_mp import checkpoint
for path in sys.argv[1:]:
    try:
        checkpoint.load_file(path)
        print(path, "ok", sep="\\t", flush=True)
    except Exception as e:
        first = (str(e).splitlines() or [""])[0]
        print(path, "refused", type(e).__name__ + ": " + first, sep="\\t", flush=True)
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """Every case: name -> (its file, the safetensors package's refusal or None)."""
    paths = write_corpus(tmp_path_factory.mktemp("corpus"))
    return {name: (path, reference_verdict(path)) for name, path in paths.items()}


def _verdicts(command: list[str], paths: list[Path]) -> dict[str, str | None]:
    """Runs ``command`` over ``paths``; each path's refusal (None: read). Fails, naming the
    file, if the reader dies on one."""
    run = subprocess.run([*command, *map(str, paths)], capture_output=True, text=True, timeout=300)
    verdicts: dict[str, str | None] = {}
    for line in run.stdout.splitlines():
        path, verdict, *message = line.split("\t")
        verdicts[path] = message[0] if verdict == "refused" else None
    if run.returncode != 0:
        dying = str(paths[len(verdicts)]) if len(verdicts) < len(paths) else "?"
        pytest.fail(f"{command[0]} died ({run.returncode}) reading {dying}: {run.stderr[-2000:]}")
    assert len(verdicts) == len(paths)
    return verdicts


def _check(cases, verdicts: dict[str, str | None], refusal_prefix: str) -> None:
    wrong = []
    for name, (path, reference) in cases.items():
        ours = verdicts[str(path)]
        if (ours is None) != (reference is None):
            wrong.append(
                f"{name}: safetensors {reference or 'reads it'}; torch_mp {ours or 'reads it'}"
            )
        elif ours is not None:
            assert ours.startswith(refusal_prefix) and str(path) in ours, (name, ours)
    assert not wrong, f"{len(wrong)} verdicts differ:\n" + "\n".join(wrong)


def test_the_corpus_covers_both_verdicts(cases):
    accepted = sum(reference is None for _, reference in cases.values())
    assert accepted >= 50 and len(cases) - accepted >= 400, (accepted, len(cases))
    assert UNSTABLE_TEXT <= set(cases)


def test_the_python_front_end_gives_the_safetensors_verdict(cases):
    paths = [path for path, _ in cases.values()]
    verdicts = _verdicts([sys.executable, "-c", PYTHON_READER], paths)
    _check(cases, verdicts, "RuntimeError: ")


def test_the_cpp_front_end_gives_the_safetensors_verdict(cases):
    assert READ_FILES.exists(), f"{READ_FILES} is not built (make build)"
    verdicts = _verdicts([str(READ_FILES)], [path for path, _ in cases.values()])
    _check(cases, verdicts, "")


def _load_each(paths: list[str]) -> list[str | None]:
    mesh = use_mesh(1)
    return [error_of(checkpoint.load, path, torch.nn.Linear(2, 2), mesh=mesh) for path in paths]


def test_a_checkpoint_load_refuses_each_malformed_file_on_every_rank(cases, tmp_path):
    # Each refused file as the shard file of a checkpoint, its checksums re-recorded as anyone
    # who edits the folder can: the header's rules, not the checksums, refuse it.
    checkpoints: dict[str, Path] = {}
    for name, (path, reference) in cases.items():
        if reference is not None:
            folder = checkpoints[name] = tmp_path / name
            folder.mkdir()
            (folder / "shard-0-0.safetensors").write_bytes(path.read_bytes())
            index = {"format": "torch_mp checkpoint", "version": 3}
            index |= {"files": ["shard-0-0.safetensors"], "metadata": {}, "checksums": {}}
            record_checksums(folder, index)
    paths = [str(folder) for folder in checkpoints.values()]
    for rank_errors in get_world(2).run(_load_each, paths):
        for (name, folder), error in zip(checkpoints.items(), rank_errors, strict=True):
            assert error and str(folder / "shard-0-0.safetensors") in error, (name, error)
