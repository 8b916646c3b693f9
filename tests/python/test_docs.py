"""The documentation runs as written: docs/tutorial.md's files are made from its blocks
(extracted, not copied) and its commands run on them under torchrun; every command marked
runnable in README.md and docs/*.md (a ```` ```bash run ```` block) runs from the repository's
root and exits 0.

A block's info string says what it is: ```` ```python train.py ```` is (a part of) the file
train.py, ```` ```diff mixtral ```` the lines that make mixtral.py from train.py (each run of
``-`` lines, found once in train.py, replaced by the ``+`` lines after it), ```` ```bash run ````
commands that the tests run, one block as one ``bash -e`` script."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_examples import _EXIT_RACE

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(path: Path) -> list[tuple[str, str]]:
    """Each fenced block of a Markdown file: (its info string, its text)."""
    return [(m.group(1).strip(), m.group(2)) for m in _FENCE.finditer(path.read_text())]


def file_of(path: Path, info: str) -> str:
    """The blocks whose info string is ``info``, joined in order."""
    parts = [text for tag, text in blocks(path) if tag == info]
    assert parts, f"{path.name} has no ```{info} block"
    return "\n".join(parts)


def patched(source: str, diff: str) -> str:
    """``source`` with the diff's runs of removed lines replaced by the added lines after each."""
    hunks: list[tuple[list[str], list[str]]] = []
    for line in diff.splitlines():
        sign, text = line[:1], line[1:]
        assert sign in ("-", "+"), f"a diff line neither removes nor adds: {line!r}"
        if sign == "-" and (not hunks or hunks[-1][1]):
            hunks.append(([], []))
        assert hunks, f"lines added before any removed: {line!r}"
        hunks[-1][0 if sign == "-" else 1].append(text)
    for removed, added in hunks:
        old = "\n".join(removed) + "\n"
        assert source.count(old) == 1, f"not found once in the file: {old!r}"
        source = source.replace(old, "\n".join(added) + "\n" if added else "")
    return source


def run_commands(
    block: str, cwd: Path, timeout: float, written: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Runs a block of commands by ``bash -e`` in ``cwd``; once more if a process died of
    Gloo's exit race (test_examples.py explains it), ``written`` (paths in ``cwd`` the block
    writes) removed first."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # (this python)

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-e", "-c", block], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    result = run()
    if result.returncode != 0 and _EXIT_RACE in result.stderr:
        for path in (cwd / name for name in written):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        result = run()
    return result


def _documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path == TUTORIAL:
            continue  # (run on its own files below)
        for number, (info, text) in enumerate(blocks(path)):
            if info == "bash run":
                found.append((f"{path.name}#{number}", text))
    return found


@pytest.mark.parametrize(("where", "commands"), _documented_commands())
def test_every_documented_command_runs_as_written(where, commands):
    result = run_commands(commands, ROOT, timeout=300)
    assert result.returncode == 0, f"{where}:\n{commands}\n{result.stdout}{result.stderr}"


def test_the_tutorial_runs_as_written(tmp_path):
    train = file_of(TUTORIAL, "python train.py")
    (tmp_path / "train.py").write_text(train)
    (tmp_path / "plot.py").write_text(file_of(TUTORIAL, "python plot.py"))
    (tmp_path / "mixtral.py").write_text(patched(train, file_of(TUTORIAL, "diff mixtral")))
    commands = [text for info, text in blocks(TUTORIAL) if info == "bash run"]
    assert len(commands) == 3, "the launches, the plot, the Mixtral run"
    launches, plot, mixtral = commands
    written = ("checkpoint", "losses.csv")

    result = run_commands(launches, tmp_path, timeout=600, written=written)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "killed at step 8" in output and "resumed after step 6" in output, output
    with open(tmp_path / "losses.csv") as log:
        rows = [(int(step), float(loss)) for step, loss in csv.reader(log)]
    assert [s for s, _ in rows] == [*range(1, 8), *range(7, 13)], rows
    before, after = (loss for step, loss in rows if step == 7)
    assert before == after, f"step 7: loss {before} before the kill, {after} after the resume"
    assert rows[-1][1] < rows[0][1], f"the loss did not fall: {rows}"

    result = run_commands(plot, tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "loss.png").stat().st_size > 0 and "13 points" in result.stdout

    result = run_commands(mixtral, tmp_path, timeout=300, written=written)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 4  loss" in result.stdout and "resumed" not in result.stdout, result.stdout
    assert (tmp_path / "checkpoint").is_dir()


def test_a_diff_that_does_not_match_is_refused():
    with pytest.raises(AssertionError, match="not found once"):
        patched("a = 1\n", "-a = 2\n+a = 3")
