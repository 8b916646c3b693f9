"""Checkpoints that notice corruption and save while training goes on: a damaged block of any
kind (a sharded weight, a replicated one, optimizer state, a fused Q/K/V part, the dense
export) is refused on every rank, naming the file and the tensor; ``verify`` lists exactly the
damaged blocks; checkpoints without checksums still load; ``async_save`` holds the state of
the moment of the call while training goes on, and a SIGKILL during its background write
leaves the previous checkpoint whole."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from conftest import get_world
from multiprocess import free_port
from reference import error_of, use_mesh
from test_checkpoint import LR, TARGETS, _dense_model, _load_extra, _parallel_step
from test_checkpoint_dense import _stage_and_rename

from torch_mp import _C, checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _header(file: str) -> tuple[int, dict]:
    """The data's start and the JSON header of the safetensors file ``file``, read here from
    the bytes (not by torch_mp)."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return 8 + length, json.loads(f.read(length))


def _flip(file: str, key: str | None = None) -> None:
    """Flips an exponent bit in each of four float32 values of the tensor ``key`` of ``file``
    (the highest byte of each, little-endian), as a bad disk or a torn copy does; a middle
    byte of a file that is not safetensors when ``key`` is None."""
    if key is None:
        positions = [os.path.getsize(file) // 2]
    else:
        start, header = _header(file)
        begin = start + header[key]["data_offsets"][0]
        positions = [begin + 4 * i + 3 for i in range(4)]
    with open(file, "r+b") as f:
        for position in positions:
            f.seek(position)
            byte = f.read(1)[0]
            f.seek(position)
            f.write(bytes([byte ^ 0x40]))


def _key(file: str, prefix: str, nth: int = 0) -> str:
    """The ``nth`` tensor key of ``file`` that starts with ``prefix``."""
    return sorted(k for k in _header(file)[1] if k.startswith(prefix))[nth]


def _train_and_save(path: str) -> None:
    mesh = use_mesh(2)
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    _parallel_step(stage, optimizer, TARGETS[0])
    checkpoint.save(path, stage, optimizer, extra={"step": 1}, rename=rename)


def _load(path: str) -> str | None:
    mesh = use_mesh(2)
    stage, rename = _stage_and_rename(_dense_model(3), mesh)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    return error_of(checkpoint.load, path, stage, optimizer, rename=rename)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tp = 2 checkpoint of the model and its AdamW state, after one step."""
    path = str(tmp_path_factory.mktemp("integrity") / "clean")
    get_world(2).run(_train_and_save, path)
    return path


# (file, the prefix of the damaged tensor's key, which of the keys with it) for each kind of block.
KINDS = {
    "sharded weight": ("shard-0-1.safetensors", "model/mlp.fc1.weight@", 0),
    "replicated weight": ("shard-0-0.safetensors", "model/norm.weight", 0),
    "optimizer state": ("shard-0-1.safetensors", "optim/mlp.fc2.weight/exp_avg_sq@", 0),
    # Rank 1's three blocks of layer 0's fused weight: Q's, K's and V's rows; K's is the 2nd.
    "fused qkv part": ("shard-0-1.safetensors", "model/layers.0.self_attn.in_proj_weight@", 1),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_damaged_block_is_refused_on_every_rank_naming_the_file_and_the_tensor(
    kind, saved, tmp_path
):
    file, prefix, nth = KINDS[kind]
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    key = _key(os.path.join(path, file), prefix, nth)
    _flip(os.path.join(path, file), key)
    for message in get_world(2).run(_load, path):
        assert message is not None, f"a damaged {kind} loaded"
        assert f"{file}: tensor {key} is corrupt" in message, message
    blocks = checkpoint.verify(path)
    assert [(b.file, b.key, b.tensor) for b in blocks] == [(file, key, key.split("@")[0])]


def test_verify_lists_exactly_the_damaged_blocks_and_a_clean_checkpoint_verifies(saved, tmp_path):
    assert checkpoint.verify(saved) == []
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    damaged = []
    for file, prefix, nth in KINDS.values():
        key = _key(os.path.join(path, file), prefix, nth)
        _flip(os.path.join(path, file), key)
        damaged.append((file, key))
    _flip(os.path.join(path, "extra.pt"))
    blocks = checkpoint.verify(path, threads=2)
    assert sorted((b.file, b.key) for b in blocks) == sorted([*damaged, ("extra.pt", "")])
    assert all(b.file in b and "corrupt" in b for b in blocks)  # each a message naming it
    # From a shell: every bad block listed, exit status 1 (0 for the clean one).
    command = [sys.executable, "-m", "torch_mp.checkpoint", "verify"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([*command, saved, path], env=env, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{saved}: " in run.stdout and ": intact" in run.stdout
    assert f"{path}: " in run.stdout and "5 corrupt" in run.stdout
    for file, key in damaged:
        assert f"{file}: tensor {key} is corrupt" in run.stdout


def test_a_damaged_or_missing_extra_is_refused_on_every_rank(saved, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    _flip(os.path.join(path, "extra.pt"))
    for message in get_world(2).run(_load, path):
        assert "extra.pt is corrupt" in message, message
    os.remove(os.path.join(path, "extra.pt"))
    for message in get_world(2).run(_load, path):
        assert "lacks extra.pt, which it was saved with" in message, message


def _rewrite_header(file: str, change) -> None:
    """Rewrites the header of the safetensors file ``file`` by ``change(text) -> text`` (of the
    same length, so that the data stays where it is)."""
    start, _ = _header(file)
    with open(file, "r+b") as f:
        f.seek(8)
        text = f.read(start - 8).decode()
        changed = change(text)
        assert len(changed) == len(text) and changed != text
        f.seek(8)
        f.write(changed.encode())


def test_a_damaged_header_or_index_is_refused_on_every_rank(saved, tmp_path):
    # One dtype letter (F32 read as I32: the same bytes, other values), the checksums' own key,
    # and a digit of a hyperparameter in index.json: each is refused, and verify names it.
    damages = {
        "dtype": ("shard-0-1.safetensors", lambda t: t.replace('"F32"', '"I32"', 1)),
        "checksum key": (
            "shard-0-0.safetensors",
            lambda t: t.replace("torch_mp.crc32c", "torch_mp.crc32d"),
        ),
    }
    for what, (file, change) in damages.items():
        path = str(tmp_path / what.replace(" ", "_"))
        shutil.copytree(saved, path)
        _rewrite_header(os.path.join(path, file), change)
        for message in get_world(2).run(_load, path):
            assert f"{file}: the header is corrupt" in message, (what, message)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the file's checksums are not found: unchecked)
            blocks = checkpoint.verify(path)
        assert (file, "") in [(b.file, b.key) for b in blocks], what
        assert {b.file for b in blocks} == {file}, what
    path = str(tmp_path / "index")
    shutil.copytree(saved, path)
    index = os.path.join(path, "index.json")
    with open(index) as f:
        text = f.read()
    assert "0.01" in text  # the learning rate, in param_groups
    with open(index, "w") as f:
        f.write(text.replace("0.01", "0.03", 1))
    for message in get_world(2).run(_load, path):
        assert "index.json is corrupt" in message, message
    assert [b.file for b in checkpoint.verify(path)] == ["index.json"]


def _crc32c(data: bytes) -> int:
    """CRC-32C bit by bit, from its definition (reflected polynomial 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_checksum_is_crc32c_as_defined():
    assert _crc32c(b"123456789") == 0xE3069283
    for size in (0, 1, 7, 8, 4096, 3 * 4096, 3 * 4096 + 13, 40000):  # short, and three streams
        data = torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
        )
        assert _C.checkpoint.crc32c(data) == _crc32c(bytes(data.tolist())), size


def _strip_checksums(path: str) -> None:
    """Rewrites the checkpoint ``path`` as torch_mp wrote it before it recorded checksums (in
    format version 2, where they are optional)."""
    for name in os.listdir(path):
        file = os.path.join(path, name)
        if name.endswith(".safetensors"):
            start, header = _header(file)
            del header["__metadata__"]["torch_mp.crc32c"]
            text = json.dumps(header).encode()
            text += b" " * (-len(text) % 8)
            with open(file, "rb") as f:
                f.seek(start)
                data = f.read()
            with open(file, "wb") as f:
                f.write(len(text).to_bytes(8, "little") + text + data)
        elif name == "index.json":
            with open(file) as f:
                index = json.load(f)
            for field in ("checksums", "header_checksums", "index_crc32c"):
                del index[field]
            index["version"] = 2
            with open(file, "w") as f:
                json.dump(index, f)


def _load_noting(path: str) -> tuple[str | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _load(path)
    return error, [str(w.message) for w in caught]


def test_a_checkpoint_without_checksums_loads_with_a_note_that_it_cannot_be_verified(
    saved, tmp_path
):
    path = str(tmp_path / "old")
    shutil.copytree(saved, path)
    _strip_checksums(path)
    for error, notes in get_world(2).run(_load_noting, path):
        assert error is None, error
        assert any("records no checksums" in n and "cannot be verified" in n for n in notes)
    with pytest.warns(UserWarning, match="cannot be verified"):
        assert checkpoint.verify(path) == []
    # In version 3 the checksums are mandatory: the same files are refused.
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(index | {"version": 3}, f)
    for message in get_world(2).run(_load, path):
        assert "index.json is not a valid checkpoint index" in message, message


def _export(path: str) -> None:
    mesh = use_mesh(2)
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    checkpoint.export_dense(path, stage, rename=rename, mesh=mesh)


def _load_dense(path: str) -> str | None:
    mesh = use_mesh(2)
    stage, rename = _stage_and_rename(_dense_model(3), mesh)
    return error_of(checkpoint.load_dense, path, stage, rename=rename)


def test_a_damaged_dense_export_is_refused_and_the_file_stays_safetensors(tmp_path):
    file = str(tmp_path / "model.safetensors")
    world = get_world(2)
    world.run(_export, file)
    read = safetensors.torch.load_file(file)  # the safetensors package reads it as before
    expected = _dense_model().state_dict()
    assert sorted(read) == sorted(expected)
    assert all(torch.equal(read[k], v) for k, v in expected.items())
    assert checkpoint.verify(file) == []
    key = "mlp.fc1.weight"
    _flip(file, key)
    for message in world.run(_load_dense, file):
        assert f"{file}: tensor {key} is corrupt" in message, message
    with pytest.raises(RuntimeError, match=f"tensor {key} is corrupt"):
        checkpoint.load_file(file)
    assert [(b.file, b.key) for b in checkpoint.verify(file)] == [(file, key)]
    # A dense file has no index: its tensors' checksums cover their dtype and shape too.
    world.run(_export, file)
    _rewrite_header(file, lambda t: t.replace('"F32"', '"I32"', 1))
    with pytest.raises(RuntimeError, match="is corrupt"):
        checkpoint.load_file(file)


BIG = torch.ones(32 << 20)  # 128 MiB of extra: a write that lasts while training steps run


def _async_save_then_train(path: str, reference: str) -> bool:
    """Saves (synchronously, as the reference) and starts an async save of the same state,
    then trains three steps before waiting for it; returns whether the save was still running
    when the steps began (so that they changed the tensors while it wrote)."""
    mesh = use_mesh(2)
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    _parallel_step(stage, optimizer, TARGETS[0])
    extra = {"step": 1, "big": BIG}
    checkpoint.save(reference, stage, optimizer, extra=extra, rename=rename)
    handle = checkpoint.async_save(path, stage, optimizer, extra=extra, rename=rename)
    overlapped = not handle.done()
    for i in range(3):
        _parallel_step(stage, optimizer, TARGETS[i % 2])  # in place, while the save writes
    handle.wait()
    assert handle.done()
    return overlapped


def _load_at_tp1(path: str) -> tuple[dict, dict]:
    """The model and optimizer state loaded from ``path`` at tp = 1, as dense tensors."""
    mesh = use_mesh(1)
    stage, rename = _stage_and_rename(_dense_model(3), mesh)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=0.5)
    extra = checkpoint.load(path, stage, optimizer, rename=rename)
    assert extra["step"] == 1 and torch.equal(extra["big"], BIG)
    names = {p: n for n, p in stage.named_parameters()}
    moments = {names[p]: s["exp_avg"].clone() for p, s in optimizer.state.items()}
    return checkpoint.dense_state_dict(stage, rename), moments


def test_an_async_save_holds_the_state_of_the_moment_of_the_call(tmp_path):
    # At tp = 2 on four ranks (dp = 2: the data-parallel replicas write no file), loaded at
    # tp = 1 on two.
    path, reference = str(tmp_path / "async"), str(tmp_path / "sync")
    overlapped = get_world(4).run(_async_save_then_train, path, reference)
    assert all(overlapped), "the save was done before the training steps: nothing was tested"
    assert checkpoint.verify(path) == []
    for (weights, moments), (want_weights, want_moments) in zip(
        get_world(2).run(_load_at_tp1, path), get_world(2).run(_load_at_tp1, reference), strict=True
    ):
        assert sorted(weights) == sorted(want_weights)
        assert all(torch.equal(weights[k], want_weights[k]) for k in weights)
        assert sorted(moments) == sorted(want_moments)
        assert all(torch.equal(moments[k], want_moments[k]) for k in moments)


def _two_async_saves_and_a_failing_one(root: str) -> tuple[bool, str | None]:
    mesh = use_mesh(2)
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    first = checkpoint.async_save(os.path.join(root, "a"), stage, extra=BIG, rename=rename)
    second = checkpoint.async_save(os.path.join(root, "b"), stage, rename=rename)
    first_done = first.done()  # the second waited for it
    second.wait()
    blocker = os.path.join(root, "file")
    if dist.get_rank() == 0:
        with open(blocker, "w") as f:
            f.write("a file where the checkpoint's parent directory should be")
    dist.barrier()
    failing = checkpoint.async_save(os.path.join(blocker, "ckpt"), stage, rename=rename)
    return first_done, error_of(failing.wait)


def test_a_second_async_save_waits_for_the_first_and_failures_surface_at_wait(tmp_path):
    for first_done, error in get_world(2).run(_two_async_saves_and_a_failing_one, str(tmp_path)):
        assert first_done
        assert error is not None and "torch_mp::checkpoint::save of" in error, error
        assert "file/ckpt failed on rank 0" in error, error
    assert checkpoint.verify(str(tmp_path / "a")) == []


_ASYNC_SAVER = """
import sys, datetime, time, torch, torch.distributed as dist
import torch_mp
from torch_mp import checkpoint
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch_mp.init()
model = torch.nn.Linear(4, 4)
checkpoint.save(sys.argv[1], model, extra="first")
print("saved", flush=True)
checkpoint.async_save(sys.argv[1], model, extra=torch.ones(64 << 20))  # 256 MiB to write
print("started", flush=True)
while True:  # training goes on until the process is killed
    model(torch.randn(8, 4)).sum().backward()
    time.sleep(0.001)
"""


def test_a_sigkill_during_the_background_write_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt"
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    saver = subprocess.Popen(
        [sys.executable, "-c", _ASYNC_SAVER, str(path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert saver.stdout.readline().strip() == "saved"
        assert saver.stdout.readline().strip() == "started"  # async_save returned
        deadline = time.monotonic() + 60
        partial = []
        while time.monotonic() < deadline and not partial:  # its thread is writing
            partial = [p for p in tmp_path.iterdir() if ".partial-" in p.name]
            time.sleep(0.001)
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=30)
    finally:
        saver.kill()
    assert partial, "the background save never started writing"
    assert get_world(1).run(_load_extra, str(path)) == ["first"]
    assert checkpoint.verify(str(path)) == []
