"""Checkpoints across front ends: the C++ GPT example (examples/cpp/gpt_3d.cpp), launched with
torchrun, saves a checkpoint that Python loads, and resumes from one that Python saved; the
dense model's logits agree on both sides.

Both sides run one model: csrc/torch_mp/models/gpt.h is the C++ twin of
torch_mp.models.DenseGPT (run here at GPTConfig's default sizes). Logits are compared to 1e-5:
LibTorch's and Python's multi-head attention are the same maths in another order."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from conftest import get_world
from reference import use_mesh

from torch_mp import checkpoint
from torch_mp.models import Corpus, DenseGPT, GPTConfig, GPTStage

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / os.environ.get("TORCH_MP_BUILD", "build") / "examples/cpp/gpt_3d"
TORCHRUN = Path(os.sys.executable).with_name("torchrun")
TOLERANCE = 1e-5
SIZES = ("--hidden", "32", "--ffn", "64", "--batch", "8")  # GPTConfig's defaults, a small batch


def _dense(seed: int) -> DenseGPT:
    torch.manual_seed(seed)
    return DenseGPT(GPTConfig(Corpus().vocab))  # the example's corpus


def _torchrun(nproc: int, *args: str) -> str:
    assert EXAMPLE.exists(), f"{EXAMPLE} is not built (make build)"
    result = subprocess.run(
        [str(TORCHRUN), "--standalone", "--no-python", f"--nproc-per-node={nproc}", str(EXAMPLE)]
        + list(SIZES + args),
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _logits_after_loading(path: str, probe: str) -> float:
    use_mesh(1)
    model = _dense(seed=5)  # other values until loaded
    assert checkpoint.load(path, model) == {"step": "2"}  # the C++ extra: strings
    expected = checkpoint.load_file(probe)[0]
    with torch.no_grad():
        return (model(expected["tokens"]) - expected["logits"]).abs().max().item()


def test_a_checkpoint_the_cpp_example_saved_loads_in_python_with_equal_logits(tmp_path):
    path, probe = str(tmp_path / "cpp_ckpt"), str(tmp_path / "probe.safetensors")
    # (--zero: the AdamW state is saved from a DistributedOptimizer; --recompute full --check:
    # the recomputed layers train as the one-process model does)
    _torchrun(2, "--tp", "2", "--steps", "2", "--save-every", "2", "--checkpoint", path,
              "--probe", probe, "--zero", "--recompute", "full", "--check")  # fmt: skip
    assert sorted(os.listdir(path)) == [
        "index.json",
        "shard-0-0.safetensors",
        "shard-0-1.safetensors",
    ]
    [difference] = get_world(1).run(_logits_after_loading, path, probe)
    assert difference < TOLERANCE, difference


def _save_from_python(path: str) -> None:
    use_mesh(2)
    model = GPTStage(_dense(seed=3), range(4), first=True, last=True)
    checkpoint.save(path, model, extra={"step": 0}, rename=model.dense_names())


def test_the_cpp_example_resumes_from_a_python_checkpoint_with_equal_logits(tmp_path):
    # Saved by Python at tp = 2, loaded by C++ at pp = 2: resharded on the way.
    path, probe = str(tmp_path / "py_ckpt"), str(tmp_path / "probe.safetensors")
    get_world(2).run(_save_from_python, path)
    out = _torchrun(2, "--pp", "2", "--steps", "0", "--resume", "--checkpoint", path,
                    "--probe", probe)  # fmt: skip
    assert f"resumed from {path} after step 0" in out
    expected = checkpoint.load_file(probe)[0]
    with torch.no_grad():
        logits = _dense(seed=3)(expected["tokens"])
    assert (logits - expected["logits"]).abs().max().item() < TOLERANCE


def _losses(out: str) -> dict[str, str]:
    """The loss the example printed for each step ("[####...] step 5/6  loss 4.3166")."""
    return {
        line.split("step ")[1].split()[0]: line.split("loss ")[1].split()[0]
        for line in out.splitlines()
        if line.startswith("[") and " loss " in line
    }


def test_the_cpp_example_resumes_at_another_layout_on_the_uninterrupted_loss_curve(tmp_path):
    # A run of 6 steps (its learning rate decays until step 6) stops after step 4.
    path, run = str(tmp_path / "ckpt"), ("--decay-steps", "6", "--sample", "0")
    _torchrun(2, "--tp", "2", "--steps", "4", "--save-every", "2", "--checkpoint", path, *run)
    resumed = _losses(
        _torchrun(2, "--pp", "2", "--steps", "6", "--resume", "--checkpoint", path, *run)
    )
    whole = _losses(_torchrun(2, "--pp", "2", "--steps", "6", *run))
    assert sorted(resumed) == ["5/6", "6/6"]
    assert resumed == {step: whole[step] for step in resumed}
