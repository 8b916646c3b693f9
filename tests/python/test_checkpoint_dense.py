"""Dense interchange (torch_mp.checkpoint.export_dense / load_dense): a model of any tensor x
pipeline layout written as the dense model's state dict and read back into another layout,
exactly; the file is real safetensors; a crashed write leaves the previous file whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import error_of, use_mesh
from torch import nn

import torch_mp
from torch_mp import checkpoint
from torch_mp.dense import MLP, ConvBlock

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 13, 8, 4, 16, 2  # 13 rows: padded at 2 and 4 ranks


class DenseModel(nn.Module):
    """Embedding, transformer layers, norm, MLP, a conv block, and a head tied to the
    embedding (``tok.weight``)."""

    def __init__(self, seed: int, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", norm_first=True, bias=bias
            )
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP(HIDDEN, FFN)
        self.conv = ConvBlock(2, 4, 2)
        with torch.no_grad():  # running statistics that are not the defaults
            self.conv.norm.running_mean.uniform_(-1, 1)
            self.conv.norm.running_var.uniform_(0.5, 2)


class Stage(nn.Module):
    """Part of ``DenseModel`` in tensor-parallel modules: the first stage holds the embedding,
    the last the norm, MLP, conv block and the head (the embedding, tied)."""

    def __init__(self, dense: DenseModel, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.tok = torch_mp.VocabParallelEmbedding.from_dense(dense.tok)
        self.layers = nn.ModuleList(
            torch_mp.ParallelTransformerLayer.from_dense(dense.layers[i]) for i in layers
        )
        if last:
            self.norm = torch_mp.tensor_parallel.LayerNorm.from_dense(dense.norm)
            self.mlp = torch_mp.ParallelMLP.from_dense(dense.mlp)
            self.conv = torch_mp.ParallelConvBlock.from_dense(dense.conv)
            # The head is the embedding itself when one stage holds both, as in the dense
            # model; otherwise a copy (a pipeline ties the two copies' gradients).
            self.head = self.tok if first else torch_mp.VocabParallelEmbedding.from_dense(dense.tok)

    def forward_all(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        # Every rank's vocabulary rows see the same h: its gradient sums over the ranks.
        h = torch_mp.functional.copy_to_tp(self.mlp(self.norm(x)))
        return h @ self.head.weight.T


def _stage_and_rename(dense: DenseModel, mesh) -> tuple[Stage, dict[str, str]]:
    """This rank's stage of ``dense`` at the mesh's pipeline size, and the map from its names
    to the dense model's (its layers renumbered, the head to the embedding it is tied to)."""
    p, s = mesh.pp_size, mesh.pp_rank
    per = LAYERS // p
    layers = range(s * per, (s + 1) * per)
    stage = Stage(dense, layers, first=s == 0, last=s == p - 1)
    rename = {f"layers.{i}.": f"layers.{layers[i]}." for i in range(per)}
    rename["head.weight"] = "tok.weight"
    return stage, rename


def _roundtrip(tp: int, pp: int, path: str) -> None:
    """Exports a (tp, pp) model of DenseModel(0): the file is DenseModel(0)'s state dict; loads it
    into a (tp, pp) model of DenseModel(1): that model exports the same file again."""
    mesh = use_mesh(tp, pp)
    source = DenseModel(0)
    stage, rename = _stage_and_rename(source, mesh)
    written = checkpoint.export_dense(path, stage, rename=rename, mesh=mesh)
    dist.barrier()
    tensors, _ = checkpoint.load_file(path)
    expected = source.state_dict()
    assert sorted(tensors) == sorted(expected), sorted(set(tensors) ^ set(expected))
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key
    if dist.get_rank() == 0:
        assert sorted(written) == sorted(expected)
    reloaded = DenseModel(0)
    reloaded.load_state_dict(tensors, strict=True)  # what a dense user does with the file

    other, rename = _stage_and_rename(DenseModel(1), mesh)
    checkpoint.load_dense(path, other, rename=rename)
    again = checkpoint.dense_state_dict(other, rename)
    for key, value in again.items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)])
def test_export_is_the_dense_state_dict_and_loads_back_exactly(tp, pp, tmp_path):
    world = get_world(tp * pp)
    world.run(_roundtrip, tp, pp, str(tmp_path / f"dense_{tp}_{pp}.safetensors"))


def _export(tp: int, pp: int, path: str) -> None:
    mesh = use_mesh(tp, pp)
    stage, rename = _stage_and_rename(DenseModel(0), mesh)
    checkpoint.export_dense(path, stage, rename=rename, mesh=mesh)


def _load_and_compare(tp: int, pp: int, path: str) -> float:
    """Loads the file at (tp, pp) and runs the whole model (pp = 1): the output must be the dense
    source model's."""
    mesh = use_mesh(tp, pp)
    stage, rename = _stage_and_rename(DenseModel(1), mesh)
    checkpoint.load_dense(path, stage, rename=rename)
    source = DenseModel(0)
    tokens = torch.tensor([[1, 12, 5], [0, 7, 3]])
    with torch.no_grad():
        x = source.tok(tokens)
        for layer in source.layers:
            x = layer(x)
        expected = source.mlp(source.norm(x)) @ source.tok.weight.T
        got = stage.forward_all(tokens)  # this rank's rows of the (padded) vocabulary
    rows = got.shape[-1]
    first = mesh.tp_rank * rows
    real = expected[..., first : first + rows]  # the last rank's padding rows have no reference
    return (got[..., : real.shape[-1]] - real).abs().max().item()


def test_a_file_written_at_one_layout_loads_into_another(world4, tmp_path):
    # (tp, pp) = (2, 2) written, read at tp = 4 and at tp = 1 (each rank alone).
    path = str(tmp_path / "dense.safetensors")
    world4.run(_export, 2, 2, path)
    for diff in world4.run(_load_and_compare, 4, 1, path):
        assert diff < 1e-5  # one-process forward against the tensor-parallel one
    for diff in world4.run(_load_and_compare, 1, 1, path):
        assert diff < 1e-5


def _missing_and_misshapen(path: str) -> str | None:
    mesh = use_mesh(dist.get_world_size())
    tensors = DenseModel(0).state_dict()
    if dist.get_rank() == 0:
        del tensors["layers.1.linear1.weight"]
        tensors["norm.weight"] = torch.ones(HIDDEN + 1)
        checkpoint.save_file(tensors, path)
    dist.barrier()
    stage, rename = _stage_and_rename(DenseModel(1), mesh)
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    message = error_of(checkpoint.load_dense, path, stage, rename=rename)
    for key, value in stage.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a load that failed"
    return message


def test_a_missing_or_misshapen_tensor_is_named_on_every_rank(world2, tmp_path):
    for message in world2.run(_missing_and_misshapen, str(tmp_path / "bad.safetensors")):
        assert message is not None
        assert "model/layers.1.linear1.weight is missing" in message
        assert "model/norm.weight has shape [9] in the checkpoint; this rank's needs [8]" in message


def test_the_file_is_safetensors_both_ways(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "c": torch.randn(5).to(torch.bfloat16),
        "d": torch.tensor([True, False]),
        "e": torch.empty(0, 4),
        "f": torch.tensor(3, dtype=torch.int64),  # 0-dim, as BatchNorm's num_batches_tracked
    }
    ours = tmp_path / "ours.safetensors"
    checkpoint.save_file(tensors, ours, {"step": "7"})
    theirs = safetensors_torch.load_file(str(ours))
    assert sorted(theirs) == sorted(tensors)
    for key, value in tensors.items():
        assert torch.equal(theirs[key], value), key
    back = tmp_path / "theirs.safetensors"
    safetensors_torch.save_file(tensors, str(back), metadata={"step": "7"})
    read, metadata = checkpoint.load_file(back)
    assert metadata == {"step": "7"}
    for key, value in tensors.items():
        assert torch.equal(read[key], value), key


# Every dtype torch has a safetensors name for (docs/checkpoint-format.md §9).
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8,
          torch.bool, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
          torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.complex64]  # fmt: skip


def test_every_dtype_torch_has_is_safetensors_both_ways(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    raw = torch.arange(48, dtype=torch.uint8).reshape(2, 24)
    tensors = {
        str(d).removeprefix("torch."): raw.view(d).clone() for d in DTYPES if d != torch.bool
    }
    tensors["bool"] = raw % 2 == 1
    ours, back = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    checkpoint.save_file(tensors, ours)
    safetensors_torch.save_file(tensors, str(back))
    for read in (safetensors_torch.load_file(str(ours)), checkpoint.load_file(back)[0]):
        assert sorted(read) == sorted(tensors)
        for key, value in tensors.items():
            assert read[key].dtype == value.dtype and read[key].shape == value.shape, key
            assert torch.equal(read[key].view(torch.uint8), value.view(torch.uint8)), key
    # F4: torch holds two values an element, so the file's last size is twice torch's.
    pairs = {"f4": torch.arange(6, dtype=torch.uint8).reshape(2, 3).view(torch.float4_e2m1fn_x2)}
    checkpoint.save_file(pairs, ours)
    assert (
        checkpoint.load_file(ours)[0]["f4"].view(torch.uint8).equal(pairs["f4"].view(torch.uint8))
    )
    theirs = safetensors_torch.load_file(str(ours))["f4"]
    assert theirs.dtype == torch.float4_e2m1fn_x2 and theirs.shape == (2, 3)
    assert theirs.view(torch.uint8).equal(pairs["f4"].view(torch.uint8))


_WRITER = """
import sys, torch
from torch_mp import checkpoint
print("writing", flush=True)
checkpoint.save_file({"big": torch.ones(64 << 20)}, sys.argv[1])  # 256 MiB
"""


def test_a_write_killed_midway_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "model.safetensors"
    previous = {"w": torch.arange(10.0)}
    checkpoint.save_file(previous, path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)],
        env=dict(os.environ, PYTHONPATH=root),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "writing"
    # Kill it while the temporary file is being filled.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        partial = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        if partial and partial[0].stat().st_size > (1 << 20):
            break
        time.sleep(0.001)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert partial, "the writer never started its temporary file"
    tensors, _ = checkpoint.load_file(path)
    assert torch.equal(tensors["w"], previous["w"])  # the previous file, whole
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" not in p.name] == [path.name]


def test_the_cpp_front_end_reads_and_writes_the_same_files(tmp_path):
    # The C++ reader and writer (torch_mp/checkpoint/safetensors.h) against the Python ones.
    from torch_mp import _C

    tensors = {
        "tok.weight": torch.randn(13, 8),
        "layers.0.norm1.bias": torch.randn(8).to(torch.float16),
        "count": torch.tensor(5, dtype=torch.int64),
        "mask": torch.tensor([[True, False]]),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
    }
    from_python = tmp_path / "python.safetensors"
    checkpoint.save_file(tensors, from_python, {"written by": "python"})
    read, metadata = _C.checkpoint.load_file(str(from_python))
    assert metadata == {"written by": "python"}
    for key, value in tensors.items():
        assert read[key].dtype == value.dtype and torch.equal(read[key], value), key
    from_cpp = tmp_path / "cpp.safetensors"
    _C.checkpoint.save_file(tensors, str(from_cpp), {"written by": "c++"})
    read, metadata = checkpoint.load_file(from_cpp)
    assert metadata == {"written by": "c++"}
    for key, value in tensors.items():
        assert read[key].dtype == value.dtype and torch.equal(read[key], value), key
    safetensors_torch = pytest.importorskip("safetensors.torch")
    for key, value in safetensors_torch.load_file(str(from_cpp)).items():
        assert torch.equal(value, tensors[key]), key
    with pytest.raises(RuntimeError, match="cut short"):
        cut = tmp_path / "cut.safetensors"
        cut.write_bytes(from_cpp.read_bytes()[:-4])
        _C.checkpoint.load_file(str(cut))
