"""The planner (torch_mp.plan.search and python -m torch_mp.plan): every layout it returns fits
and is ranked by its estimated step, what cannot fit is refused with the memory and the layers
that would, and the command line prints the table and the command that runs the best."""

from __future__ import annotations

import dataclasses
import json
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
        assert isinstance(c.layout, plan.Layout) and plan.Layout(**k) == c.layout
        again = plan.estimate(GPT, c.layout, machine="h100")  # (the estimate's own numbers)
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


def test_a_model_not_estimated_is_refused_by_the_command_line(capsys, tmp_path):
    config = tmp_path / "gpt2.json"
    config.write_text('{"model_type": "gpt2"}')
    argv = ["--model", str(config), "--world", "8", "--seq", "1024", "--global-batch", "8"]
    assert main(argv) == 1
    assert "model_type 'gpt2': not estimated yet" in capsys.readouterr().err


def test_experts_are_planned_over_expert_groups(capsys):
    # (in fp32: at ep > 1 the experts take no fp32 masters, which the bf16 recipe shards)
    moe = dataclasses.replace(GPT, moe_experts=8, moe_top_k=2)
    best = search(moe, memory="80GB", dtype=torch.float32, top=50, **RUN)
    assert any(c.keywords["ep"] > 1 for c in best)
    for c in best:
        k = c.keywords
        assert k["recompute"] is None and not k["sequence_parallel"] and k["cp"] == 1
        assert k["ep"] == 1 or k["zero"] == 0
    with_ep = next(c for c in best if c.keywords["ep"] > 1)
    assert f"ep{with_ep.keywords['ep']}" in with_ep.describe()


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


def test_a_mixtral_is_planned_for_mixtral_moe_py(capsys, tmp_path):
    config = tmp_path / "mixtral.json"
    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    sizes |= dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    config.write_text(json.dumps({"model_type": "mixtral", **sizes, "num_local_experts": 4}))
    argv = ["--model", str(config), "--world", "8", "--seq", "512", "--global-batch", "8"]
    assert main([*argv, "--fp32", "--top", "20"]) == 0
    out = capsys.readouterr().out
    assert " ep2 " in out or " ep4 " in out
    assert "examples/python/mixtral_moe.py --tp " in out and "--experts 4 --top-k 2" in out


@pytest.mark.parametrize(("zero", "flag"), [(0, None), (1, "--zero 1"), (3, "--zero 3")])
def test_the_llama_command_runs_the_zero_stage_that_was_estimated(zero, flag):
    from torch_mp.plan.__main__ import command, load_model

    model = load_model("llama-8b")
    keywords = {"tp": 8, "pp": 1, "dp": 8, "zero": zero, "recompute": None}
    keywords |= {"dtype": torch.float32, "micro_batch": 1, "seq_len": 8192, "num_microbatches": 1}
    candidate = plan.Candidate(keywords, None, 0)
    line = command(candidate, model, 64, plan.Machine.load("h100")).splitlines()[-1]
    assert (flag in line) if flag else ("--zero" not in line)
