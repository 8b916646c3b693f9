"""The planner (torch_mp.plan.search and python -m torch_mp.plan): every layout it returns fits
and is ranked by its estimated step, what cannot fit is refused with the memory and the layers
that would, and the command line prints the table and the command that runs the best."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torch_mp import plan
from torch_mp.models import GPTConfig
from torch_mp.plan.__main__ import main
from torch_mp.plan.search import NothingFits, search

GPT = GPTConfig(vocab=50304, seq=2048, hidden=2048, heads=16, ffn=8192, layers=24)
RUN = {"world": 16, "seq_len": 2048, "global_batch": 64, "machine": "h100", "progress": False}


def test_the_layouts_fit_and_come_fastest_first():
    best = search(GPT, memory="20GB", top=50, **RUN)
    assert len(best) == 50
    assert [c.seconds for c in best] == sorted(c.seconds for c in best)
    for c in best:
        k = c.keywords
        assert k["tp"] * k["pp"] * k["dp"] * k["cp"] == 16 and c.peak <= 20e9
        assert k["dp"] * k["micro_batch"] * k["num_microbatches"] == 64
        again = plan.estimate(GPT, machine="h100", **k)  # (the same numbers as the estimate's)
        assert again.time.seconds == c.seconds and max(r.peak for r in again.ranks) == c.peak
    assert len({c.describe() for c in best}) == 50
    # more memory: never slower
    assert search(GPT, memory="80GB", top=1, **RUN)[0].seconds <= best[0].seconds


def test_nothing_fits_names_the_memory_and_the_layers_that_would():
    with pytest.raises(NothingFits) as caught:
        search(GPT, memory="1.5GB", **RUN)
    message = str(caught.value)
    assert "nothing fits in 1.5 GB" in message and "the smallest peak is" in message
    layers = int(message.split("at most ")[1].split(" ")[0])
    assert 0 < layers < 24
    fewer = GPTConfig(**{**GPT.__dict__, "layers": layers})
    assert search(fewer, memory="1.5GB", top=1, **RUN)
    with pytest.raises(NothingFits):
        search(GPTConfig(**{**GPT.__dict__, "layers": layers + 1}), memory="1.5GB", **RUN)


def test_what_the_model_cannot_take_is_said_before_the_search():
    with pytest.raises(ValueError, match="seq_len"):
        search(GPT, memory="80GB", **{**RUN, "seq_len": 4096})
    with pytest.raises(ValueError, match="give memory"):
        search(GPT, **{**RUN, "machine": plan.Machine(flops=1e12, memory_bandwidth=1e3)})


def test_the_command_line_prints_the_table_and_the_best_command(capsys):
    assert (
        main(["--model", "gpt2-xl", "--world", "16", "--seq", "1024", "--global-batch", "64"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n| ") == 11  # the header and ten layouts
    command = out.split("the best:\n")[1]
    assert "torchrun --nnodes=2 --nproc-per-node=8 examples/python/gpt_3d.py --tp " in command
    assert "--hidden 1600 --heads 25 --ffn 6400 --layers 48" in command


def test_a_hugging_face_decoder_is_planned_for_llama_py(capsys):
    argv = ["--model", "llama-8b", "--world", "8", "--seq", "4096", "--global-batch", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "examples/python/llama.py --tp " in out and "--bf16" in out
    assert " pp1 " in out and " pp2 " not in out  # (parallelize runs a decoder at pp 1)


def test_a_model_not_estimated_is_refused_by_the_command_line(capsys):
    argv = ["--model", "mixtral-8x7b", "--world", "64", "--seq", "4096", "--global-batch", "64"]
    assert main(argv) == 1
    assert "mixtral" in capsys.readouterr().err


def test_python_m_torch_mp_plan_runs():
    argv = ["--model", "gpt2-xl", "--world", "8", "--seq", "1024", "--global-batch", "16"]
    done = subprocess.run(
        [sys.executable, "-m", "torch_mp.plan", *argv, "--top", "3", "--machine", "h200"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "H200" in done.stdout and done.stdout.count("\n| ") == 4


def test_fp32_is_planned_without_the_recipe():
    best = search(GPT, memory="80GB", dtype=torch.float32, top=5, **RUN)
    assert all(c.keywords["dtype"] == torch.float32 for c in best)
