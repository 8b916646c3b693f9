"""torch_mp.models.gpt: GPT-2's initialisation, the learning-rate schedule, the byte corpus and
sampling. (Training it on tp x pp x dp ranks against one process: test_gpt_3d.py; the C++
twin, csrc/torch_mp/models/gpt.h, is checked against the same numbers in
tests/cpp/models_gpt_test.cpp.)"""

from __future__ import annotations

import math

import pytest
import torch

from torch_mp.models import (
    Corpus,
    DenseGPT,
    GPTConfig,
    TrainingOptions,
    gpt2_init_std,
    learning_rate,
    sample,
)


def test_every_table_and_projection_starts_at_gpt2s_standard_deviation():
    torch.manual_seed(0)
    layers = 4
    model = DenseGPT(GPTConfig(vocab=62, seq=256, hidden=256, heads=4, ffn=1024, layers=layers))
    residual = 0.02 / math.sqrt(2 * layers)
    expected = {
        "tok.weight": 0.02,
        "pos.weight": 0.02,
        "layers.0.self_attn.in_proj_weight": 0.02,
        "layers.0.self_attn.out_proj.weight": residual,
        "layers.0.linear1.weight": 0.02,
        "layers.0.linear2.weight": residual,
    }
    for name, std in expected.items():
        assert gpt2_init_std(name, layers) == pytest.approx(std), name
    checked = 0
    for name, parameter in model.named_parameters():
        std = gpt2_init_std(name, layers)
        if std is None:  # LayerNorms: weight 1, bias 0
            assert "norm" in name
            assert torch.equal(parameter, torch.full_like(parameter, name.endswith("weight")))
            continue
        # Of >= 65k draws: the sample's std is within 1.5 % of the true one (4 sigma).
        assert parameter.std().item() == pytest.approx(std, rel=0.03), name
        assert abs(parameter.mean().item()) < 4 * std / math.sqrt(parameter.numel()), name
        checked += 1
    assert checked == 2 + 4 * layers


def test_the_learning_rate_warms_up_then_follows_a_half_cosine_to_min_lr():
    options = TrainingOptions(lr=1e-3, warmup=10, decay_steps=110, min_lr=1e-4)
    # The same points as the C++ schedule's test.
    assert learning_rate(options, 1) == pytest.approx(1e-4)
    assert learning_rate(options, 10) == pytest.approx(1e-3)
    assert learning_rate(options, 60) == pytest.approx(5.5e-4)  # half way down
    assert learning_rate(options, 110) == pytest.approx(1e-4)
    assert learning_rate(options, 200) == pytest.approx(1e-4)
    assert learning_rate(TrainingOptions(lr=2e-3), 50) == 2e-3  # no schedule: constant


def test_the_corpus_is_the_shipped_text_as_bytes():
    corpus = Corpus()
    text = corpus.decode(corpus.ids[:200].tolist())
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    assert corpus.vocab == len(set(corpus.ids.tolist())) < 256
    inputs, target = corpus.batch(3, 4, 16)
    assert inputs.shape == target.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], target[:, :-1])  # the next byte
    assert torch.equal(corpus.batch(3, 4, 16)[0], inputs)  # the same on every rank


def test_sampling_continues_the_prompt_greedily_or_reproducibly_at_a_temperature():
    torch.manual_seed(0)
    model = DenseGPT(GPTConfig(vocab=20, seq=8, hidden=16, heads=2, ffn=32, layers=2))
    prompt = torch.tensor([[1, 2, 3]])
    greedy = sample(model, prompt, 12, temperature=0)
    assert greedy.shape == (1, 15) and torch.equal(greedy[:, :3], prompt)
    with torch.no_grad():  # each greedy token is the argmax given the (windowed) tokens before
        assert greedy[0, -1] == model(greedy[:, -9:-1])[-1, 0].argmax()
    drawn = [sample(model, prompt, 12, 1.0, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(drawn[0], drawn[1])
    assert 0 <= drawn[0].min() and drawn[0].max() < 20
