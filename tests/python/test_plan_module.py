"""torch_mp.plan.estimate of a language model that is neither torch_mp's GPT nor a Hugging Face
decoder (torch_mp.plan.module): built on the meta device, traced whole on fake tensors, held to
what the ranks allocate training a real copy under DataParallel (ZeRO 0 to 3, fp32 and the bf16
recipe) within the GPT's bounds, at 1, 2 and 4 ranks; and what it cannot take, refused."""

from __future__ import annotations

import pytest
import torch
from reference import use_mesh
from torch import nn

from torch_mp import plan
from torch_mp.plan.validation import out_of_bounds

SMALL = {"micro_batch": 2, "seq_len": 64}
BF16 = {"dtype": torch.bfloat16}


class TinyLM(nn.Module):
    """A language model of plain torch modules: an embedding, two residual MLP blocks (their
    norms with biases), a final norm and an untied head."""

    def __init__(self, vocab: int = 96, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _gpt2(device: str) -> nn.Module:
    """A small Hugging Face GPT-2 (tied head, biases, learned positions): not a decoder the
    estimate knows the layers of."""
    import transformers

    sizes = dict(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    config = transformers.GPT2Config(**sizes, bos_token_id=0, eos_token_id=0)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(config)


def _model(name: str, device: str) -> nn.Module:
    if name == "gpt2":
        return _gpt2(device)
    with torch.device(device):
        return TinyLM()


LAYOUTS = {
    1: [{}, BF16, {"model": "gpt2"}],
    2: [
        {"dp": 2},
        {"dp": 2, "zero": 1},
        {"dp": 2, "zero": 2},
        {"dp": 2, "zero": 3},
        {"dp": 2, **BF16},
        {"model": "gpt2", "dp": 2, "zero": 2},
        {"model": "gpt2", "dp": 2, **BF16},
    ],
    4: [{"dp": 4, "zero": 3}, {"dp": 4, **BF16}],
}


def _validate(world_size: int) -> list[str]:
    mesh = use_mesh(1)
    failures = []
    for layout in LAYOUTS[world_size]:
        layout = {**SMALL, **layout}
        name = layout.pop("model", "tiny")
        failures.append(
            out_of_bounds(_model(name, "cpu"), _model(name, "meta"), mesh, layout, name)
        )
    return [f for f in failures if f]


def test_a_module_on_the_meta_device_is_estimated_within_its_bounds(world):
    failures = [f for rank in world.run(_validate, world.size) for f in rank]
    assert not failures, "\n".join(failures)


def test_its_parts_come_from_its_parameters_and_zero_shards_them():
    model = _model("tiny", "meta")
    numel = sum(p.numel() for p in model.parameters())
    whole = plan.estimate(model, **SMALL).ranks[0]
    assert whole.parameters == whole.gradients == 4 * numel
    assert whole.optimizer_state == 2 * 4 * numel
    assert whole.activations > 0 and plan.estimate(model, **SMALL).flops_per_rank > 0
    sharded = plan.estimate(model, dp=4, zero=3, **SMALL).ranks[0]
    assert sharded.parameters < whole.parameters / 3
    longer = plan.estimate(model, micro_batch=2, seq_len=128).ranks[0]
    assert longer.activations > 1.9 * whole.activations


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"tp": 2}, "split over data ranks only: tp and pp must be 1 and recompute None, got tp=2"),
        ({"pp": 2}, "tp and pp must be 1 and recompute None, got tp=1, pp=2"),
        ({"recompute": "full"}, "recompute None"),
        ({"cp": 2}, "context parallelism"),
        ({"ep": 2}, "needs MoE layers"),
    ],
)
def test_a_split_it_cannot_take_is_refused_by_name(keywords, message):
    with pytest.raises(ValueError, match=message):
        plan.estimate(_model("tiny", "meta"), **SMALL, **keywords)


def test_what_cannot_be_traced_is_refused_clearly():
    with pytest.raises(TypeError, match="Linear has no nn.Embedding"):
        plan.estimate(nn.Linear(2, 2), **SMALL)
    frozen = _model("tiny", "meta")
    frozen.head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="head.weight does not require grad"):
        plan.estimate(frozen, **SMALL)

    class Pooled(TinyLM):
        def forward(self, ids):
            return super().forward(ids).mean(1)

    with pytest.raises(ValueError, match="seq_len=128 exceeds the model's 64 positions"):
        plan.estimate(_model("gpt2", "meta"), micro_batch=2, seq_len=128)
    with pytest.raises(ValueError, match=r"must return logits .* returned \(2, 96\)"):
        plan.estimate(Pooled().to("meta"), **SMALL)
