"""torch_mp.checkpoint.save / load: model and AdamW state saved at one layout, loaded at another;
the next step equals the one-process model's; incomplete checkpoints are refused."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from conftest import get_world
from multiprocess import free_port
from reference import error_of, use_mesh
from test_checkpoint_dense import VOCAB, DenseModel, _stage_and_rename
from torch import nn

import torch_mp
from torch_mp import checkpoint

LR = 1e-2
TOKENS = torch.tensor([[1, 12, 5, 3], [0, 7, 3, 11]])
TARGETS = [torch.tensor([[2, 4, 6, 8], [1, 3, 5, 12]]), torch.tensor([[0, 9, 9, 1], [12, 2, 2, 7]])]


def _dense_model(seed: int = 0) -> DenseModel:
    # No biases in the transformer layers: the attention's key bias has a gradient of rounding
    # noise, which AdamW would turn into real updates that no two summation orders share.
    return DenseModel(seed, bias=False)


def _dense_step(model: DenseModel, optimizer, target: torch.Tensor) -> None:
    x = model.tok(TOKENS)
    for layer in model.layers:
        x = layer(x)
    logits = model.mlp(model.norm(x)) @ model.tok.weight.T
    optimizer.zero_grad()
    nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    optimizer.step()


def _parallel_step(stage, optimizer, target: torch.Tensor) -> None:
    logits = stage.forward_all(TOKENS)  # this rank's vocabulary rows, padding included
    optimizer.zero_grad()
    loss = torch_mp.vocab_parallel_cross_entropy(logits, target, vocab_size=VOCAB)
    loss.backward()
    optimizer.step()


def _reference() -> tuple[dict, dict]:
    """The dense model's parameters and AdamW moments after one and after two steps."""
    model = _dense_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    names = {p: n for n, p in model.named_parameters()}
    _dense_step(model, optimizer, TARGETS[0])
    moments = {names[p]: state["exp_avg"].clone() for p, state in optimizer.state.items()}
    _dense_step(model, optimizer, TARGETS[1])
    return moments, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save(tp: int, path: str) -> None:
    mesh = use_mesh(tp)
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    _parallel_step(stage, optimizer, TARGETS[0])
    checkpoint.save(path, stage, optimizer, extra={"step": 1}, rename=rename)


def _load_and_step(tp: int, path: str) -> tuple[float, float, dict]:
    mesh = use_mesh(tp)
    stage, rename = _stage_and_rename(_dense_model(7), mesh)  # other values everywhere
    optimizer = torch.optim.AdamW(stage.parameters(), lr=0.5)  # replaced by the saved lr
    extra = checkpoint.load(path, stage, optimizer, rename=rename)
    assert optimizer.param_groups[0]["lr"] == LR
    moments_expected, weights_expected = _reference()
    # The moments as loaded at this layout: saved again from it, joined into dense tensors.
    again = f"{path}-again-{tp}"
    checkpoint.save(again, stage, optimizer, rename=rename)
    dense = f"{again}-{dist.get_rank()}.safetensors"
    checkpoint.consolidate(again, dense, prefix="optim/")
    moments = checkpoint.load_file(dense)[0]  # "<name>/<state>"
    saved = sorted(k.rsplit("/", 1)[0] for k in moments if k.endswith("/exp_avg"))
    assert saved == sorted(moments_expected)
    worst_moment = max(
        (moments[f"{name}/exp_avg"] - expected).abs().max().item()
        for name, expected in moments_expected.items()
    )
    _parallel_step(stage, optimizer, TARGETS[1])
    weights = checkpoint.dense_state_dict(stage, rename)
    worst_weight = max(
        (weights[k] - weights_expected[k]).abs().max().item()
        for k in weights
        if k in weights_expected and weights[k].is_floating_point()
    )
    return worst_moment, worst_weight, extra


def test_saved_at_one_tensor_layout_the_next_step_equals_the_dense_one_at_any_other(tmp_path):
    # Saved at tp = 2 (dp = 2 on four ranks); loaded at tp = 4, 2 and 1 (dp = 1, 2, 4). The
    # moments equal the dense model's after its first step, and the second step's weights its
    # weights after two, to the rounding of the tensor-parallel sums (AdamW divides by the
    # moments' square root, so a 1e-7 difference in a gradient shows up to about 1e-6).
    world = get_world(4)
    path = str(tmp_path / "ckpt")
    world.run(_save, 2, path)
    # Every tensor rank writes its own parts; the data-parallel replicas write nothing.
    assert sorted(os.listdir(path)) == [
        "extra.pt",
        "index.json",
        "shard-0-0.safetensors",
        "shard-0-1.safetensors",
    ]
    for tp in (4, 2, 1):
        for moment, weight, extra in world.run(_load_and_step, tp, path):
            assert moment < 1e-6, (tp, moment)
            assert weight < 1e-5, (tp, weight)
            assert extra == {"step": 1}


def _pipeline_roundtrip(path: str) -> None:
    mesh = use_mesh(2, 2)
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    checkpoint.save(path, stage, extra="pp", rename=rename)
    other, rename = _stage_and_rename(_dense_model(3), mesh)
    assert checkpoint.load(path, other, rename=rename) == "pp"
    expected = checkpoint.dense_state_dict(stage, rename)
    for key, value in checkpoint.dense_state_dict(other, rename).items():
        assert torch.equal(value, expected[key]), key


def test_pipeline_stages_save_their_own_files_and_load_back(tmp_path):
    path = str(tmp_path / "ckpt")
    get_world(4).run(_pipeline_roundtrip, path)
    assert sorted(os.listdir(path)) == [
        "extra.pt",
        "index.json",
        "shard-0-0.safetensors",
        "shard-0-1.safetensors",
        "shard-1-0.safetensors",
        "shard-1-1.safetensors",
    ]


def _refused(path: str) -> str | None:
    mesh = use_mesh(dist.get_world_size())
    stage, rename = _stage_and_rename(_dense_model(), mesh)
    return error_of(checkpoint.load, path, stage, rename=rename)


def test_an_incomplete_checkpoint_is_refused_naming_what_is_missing(tmp_path):
    world = get_world(2)
    path = str(tmp_path / "ckpt")
    world.run(_save, 2, path)
    os.remove(os.path.join(path, "shard-0-1.safetensors"))
    for message in world.run(_refused, path):
        assert "cannot read" in message and "lacks shard-0-1.safetensors" in message
    os.remove(os.path.join(path, "index.json"))  # as a save killed before its end leaves it
    for message in world.run(_refused, path):
        assert "has no index.json: the save that wrote it did not finish" in message


def test_a_second_save_replaces_the_first_only_when_complete(tmp_path):
    world = get_world(2)
    path = str(tmp_path / "ckpt")
    world.run(_save, 2, path)
    os.makedirs(f"{path}.partial-00000000000000000001")  # left by a save that died
    os.makedirs(f"{path}.previous-00000000000000000002")
    world.run(_save, 1, path)  # over it: the old one goes only once the new one is in place
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _save_without_rename(path: str) -> str | None:
    # Each stage's layers are named layers.0, layers.1 locally: saved without the rename that
    # makes them the dense model's layers 0, 1 and 2, 3, both stages write "layers.0...".
    mesh = use_mesh(1, 2)
    stage, _ = _stage_and_rename(_dense_model(), mesh)
    checkpoint.save(path, stage, rename={"head.weight": "tok.weight"})
    return error_of(checkpoint.load, path, stage, rename={"head.weight": "tok.weight"})


def test_two_stages_saving_different_tensors_under_one_name_are_refused(tmp_path):
    for message in get_world(2).run(_save_without_rename, str(tmp_path / "ckpt")):
        assert "differs between shard-0-0.safetensors and shard-1-0.safetensors" in message
        assert "rename" in message


_SAVER = """
import os, sys, datetime, torch, torch.distributed as dist
import torch_mp
from torch_mp import checkpoint
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch_mp.init()
model = torch.nn.Linear(4, 4)
checkpoint.save(sys.argv[1], model, extra="first")
print("saved", flush=True)
checkpoint.save(sys.argv[1], model, extra=torch.ones(64 << 20))  # 256 MiB to write
print("saved again", flush=True)
"""


def _load_extra(path: str):
    use_mesh(1)
    return checkpoint.load(path, nn.Linear(4, 4))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "ckpt"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        PYTHONPATH=root,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    saver = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(path)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert saver.stdout.readline().strip() == "saved"
    deadline = time.monotonic() + 60
    partial = []
    while time.monotonic() < deadline and not partial:  # the second save has begun writing
        partial = [p for p in tmp_path.iterdir() if ".partial-" in p.name]
        time.sleep(0.001)
    saver.send_signal(signal.SIGKILL)
    saver.wait(timeout=30)
    assert partial, "the second save never started"
    assert get_world(1).run(_load_extra, str(path)) == ["first"]
