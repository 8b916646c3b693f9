"""Checkpoints from elsewhere: nothing in one runs code when it is loaded, and its index cannot
reach outside it or drop its checksums. Each crafted checkpoint is what anyone who can edit the
folder can make: the files changed and every checksum re-recorded (a checksum is no signature).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import get_world
from reference import error_of, use_mesh

from torch_mp import _C, checkpoint


def crc(data: bytes) -> str:
    """The CRC-32C of ``data`` as files record it."""
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    return f"{_C.checkpoint.crc32c(tensor.to(torch.uint8)):08x}"


def header_bytes(file: Path) -> bytes:
    """A safetensors file's 8-byte length and the header it gives (as far as the file goes)."""
    data = file.read_bytes()
    return data[: 8 + int.from_bytes(data[:8].ljust(8, b"\0"), "little")]


def record_checksums(directory: str | Path, index: dict) -> None:
    """Writes ``index`` as ``directory``'s index.json with every checksum recomputed (of each
    root file it records, each file it lists, and of itself: its content without the field,
    as compact JSON), re-spaced as a tool would."""
    folder = Path(directory)
    index["checksums"] = {n: crc((folder / n).read_bytes()) for n in index.get("checksums", {})}
    index["header_checksums"] = {n: crc(header_bytes(folder / n)) for n in index["files"]}
    content = {k: v for k, v in index.items() if k != "index_crc32c"}
    index["index_crc32c"] = crc(
        json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    )
    (folder / "index.json").write_text(json.dumps(index, indent=4, ensure_ascii=False))


def index_of(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "index.json").read_text())


class Trusted:
    """A user's type in ``extra``: refused by default, allowed by add_safe_globals."""

    def __init__(self, value: int) -> None:
        self.value = value


class RunsCode:
    """A pickle that runs a shell command when it is read."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _save(path: str, extra) -> None:
    checkpoint.save(path, _model(), extra=extra, mesh=use_mesh(1))


def _load(path: str, **options) -> tuple[str | None, bool]:
    """The error a load raises (None: loaded) and whether the model kept its values."""
    model = torch.nn.Linear(4, 3)
    torch.nn.init.zeros_(model.weight)
    error = error_of(checkpoint.load, path, model, mesh=use_mesh(1), **options)
    return error, bool((model.weight == 0).all())


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_crafted_extra_pt_is_refused_and_nothing_runs(ranks, tmp_path):
    world = get_world(ranks)
    marker = tmp_path / "ran"
    for kind in ("torch.save", "plain pickle"):
        path = str(tmp_path / kind.replace(" ", "_"))
        world.run(_save, path, {"step": 1})
        payload = {"step": RunsCode(str(marker))}
        with open(os.path.join(path, "extra.pt"), "wb") as f:
            torch.save(payload, f) if kind == "torch.save" else pickle.dump(payload, f)
        record_checksums(path, index_of(path))
        for error, untouched in world.run(_load, path):
            assert error and f"{path}/extra.pt" in error, (kind, error)
            assert "posix.system" in error, error  # (the global the pickle names)
            assert "add_safe_globals" in error and "weights_only=False" in error, error
            assert untouched, "the model changed before extra.pt was refused"
        assert not marker.exists(), f"{kind}: loading the checkpoint ran its code"


def _resume_state() -> dict:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    scheduler.step()
    random.seed(5)
    torch.manual_seed(5)
    return {
        "step": 7,
        "tokens": 123_456,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "scheduler": scheduler.state_dict(),
    }


def _resume(path: str) -> bool:
    expected = _resume_state()
    _save(path, expected)
    loaded = checkpoint.load(path, torch.nn.Linear(4, 3), mesh=use_mesh(1))
    assert torch.equal(loaded.pop("torch_rng"), expected.pop("torch_rng"))
    return loaded == expected


def test_a_normal_resume_loads_with_the_default(world2, tmp_path):
    assert world2.run(_resume, str(tmp_path / "ckpt")) == [True, True]


def _save_error(path: str, extra, **options) -> str | None:
    return error_of(checkpoint.save, path, _model(), extra=extra, mesh=use_mesh(1), **options)


def _trusted_round_trip(path: str) -> int:
    torch.serialization.add_safe_globals([Trusted])
    try:
        _save(path, {"mine": Trusted(3)})
        return checkpoint.load(path, torch.nn.Linear(4, 3), mesh=use_mesh(1))["mine"].value
    finally:
        torch.serialization.clear_safe_globals()


def _untrusted_round_trip(path: str) -> int:
    model, mesh = _model(), use_mesh(1)
    checkpoint.save(path, model, extra=Trusted(4), mesh=mesh, weights_only=False)
    return checkpoint.load(path, model, mesh=mesh, weights_only=False).value


def test_save_refuses_what_the_default_load_would_refuse_and_allow_lists_work(world2, tmp_path):
    for error in world2.run(_save_error, str(tmp_path / "refused"), {"mine": Trusted(1)}):
        assert error and "test_untrusted_checkpoints.Trusted" in error, error
        assert "weights_only=False" in error and "add_safe_globals" in error, error
    assert not (tmp_path / "refused").exists()
    assert world2.run(_trusted_round_trip, str(tmp_path / "allowed")) == [3, 3]
    assert world2.run(_untrusted_round_trip, str(tmp_path / "trusted")) == [4, 4]


def _load_all(paths: list[str]) -> list[str | None]:
    return [_load(path)[0] for path in paths]


def _crafted_indexes(saved: str, root: Path) -> dict[str, tuple[str, str]]:
    """Checkpoints whose index breaks a rule: name -> (path, what the refusal names)."""
    outside = root / "elsewhere.safetensors"
    shutil.copy(os.path.join(saved, "shard-0-0.safetensors"), outside)
    cases = {}

    def crafted(name: str, change, names: str) -> None:
        path = root / name
        shutil.copytree(saved, path)
        index = index_of(path)
        change(path, index)
        cases[name] = (str(path), names)

    def lists(file: str):
        def change(path: Path, index: dict) -> None:
            moved = path / file  # (outside, the file is already there)
            moved.parent.mkdir(exist_ok=True)
            (path / "shard-0-0.safetensors").rename(moved)
            index["files"] = [file]
            record_checksums(path, index)

        return change

    crafted("parent", lists("../elsewhere.safetensors"), "../elsewhere.safetensors")
    crafted("absolute", lists(str(outside)), str(outside))
    crafted("subfolder", lists("sub/shard.safetensors"), "sub/shard.safetensors")

    def link(path: Path, index: dict) -> None:
        (path / "shard-0-0.safetensors").unlink()
        (path / "shard-0-0.safetensors").symlink_to(outside)
        record_checksums(path, index)

    crafted("link", link, "a link")

    def root_file_outside(path: Path, index: dict) -> None:
        shutil.copy(path / "extra.pt", root / "extra.pt")
        index["checksums"] = {"../extra.pt": ""}
        record_checksums(path, index)

    crafted("root_file_outside", root_file_outside, "../extra.pt")

    def without(field: str):
        def change(path: Path, index: dict) -> None:
            record_checksums(path, index)
            index = index_of(path)
            del index[field]
            (path / "index.json").write_text(json.dumps(index))

        return change

    for field in ("index_crc32c", "header_checksums", "checksums"):
        crafted(f"no_{field}", without(field), field)

    def unrecorded_extra(path: Path, index: dict) -> None:
        index["checksums"] = {}
        record_checksums(path, index)

    crafted("unrecorded_extra", unrecorded_extra, "records no checksum of it")
    return cases


def test_an_index_cannot_reach_outside_or_drop_its_checksums(world2, tmp_path):
    saved = str(tmp_path / "saved")
    world2.run(_save, saved, {"step": 1})
    cases = _crafted_indexes(saved, tmp_path)
    paths = [path for path, _ in cases.values()]
    for errors in world2.run(_load_all, paths):
        for (name, (_, names)), error in zip(cases.items(), errors, strict=True):
            assert error and names in error, (name, error)
    # The C++ front end reads indexes with the same code (extra.pt is Python's); verify says
    # the same.
    reader = Path(os.environ.get("TORCH_MP_BUILD", "build")) / "tests/cpp/read_files"
    indexes = [path for name, (path, _) in cases.items() if name != "unrecorded_extra"]
    lines = subprocess.run(
        [str(reader), *indexes], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert [line.split("\t")[1] for line in lines] == ["refused"] * len(indexes), lines
    for name in ("no_index_crc32c", "parent"):
        assert [b.file for b in checkpoint.verify(cases[name][0])] == ["index.json"], name


def _load_noting(path: str) -> tuple[str | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _load(path)[0]
    return error, [str(w.message) for w in caught]


def test_a_re_spaced_index_still_loads_and_a_version_2_one_loads_unchecked(world2, tmp_path):
    saved = str(tmp_path / "saved")
    world2.run(_save, saved, {"step": 1})
    spaced = tmp_path / "spaced"
    shutil.copytree(saved, spaced)
    index = index_of(spaced)
    (spaced / "index.json").write_text(json.dumps(index, indent=8, ensure_ascii=True))
    for error, notes in world2.run(_load_noting, str(spaced)):
        assert error is None and notes == [], (error, notes)
    assert checkpoint.verify(str(spaced)) == []
    old = tmp_path / "old"
    shutil.copytree(saved, old)
    index = index_of(old)
    index["version"] = 2
    for field in ("checksums", "header_checksums", "index_crc32c"):
        del index[field]
    (old / "index.json").write_text(json.dumps(index))
    for error, notes in world2.run(_load_noting, str(old)):
        assert error is None, error
        assert any("version 2" in n and "cannot be verified" in n for n in notes), notes
    with pytest.warns(UserWarning, match="version 2"):
        assert checkpoint.verify(str(old)) == []
    command = [sys.executable, "-m", "torch_mp.checkpoint", "verify", str(old)]
    assert subprocess.run(command, capture_output=True).returncode == 2
