"""Pipelining a model that is not an nn.Sequential: torch.distributed.pipelining's tracer splits a
Hugging Face GPT-2 (``pipeline(module, mb_args, split_spec)``), torch_mp.pipeline.traced_stage
takes this rank's stage (passing on the attention mask the first stage makes and every later
one reads) and torch_mp's Pipeline runs it, the output head tied to the input embedding across
the pipeline: the loss and every gradient equal the one-process model's, at 2 and 4 stages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import assert_close, use_mesh
from torch import nn
from torch.nn import functional as F

from torch_mp import pipeline

transformers = pytest.importorskip("transformers")
pipelining = pytest.importorskip("torch.distributed.pipelining")

VOCAB, SEQ, BATCH, MICROBATCHES = 64, 16, 4, 2
# Gradients are sums over batch x sequence positions, taken per micro-batch and then summed.
GRAD_ATOL = 1e-5


class Logits(nn.Module):
    """GPT2LMHeadModel as a function of the token ids alone (the tracer wants tensors out)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(ids, use_cache=False).logits


def _gpt2() -> Logits:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=4,
        n_head=4,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Logits(transformers.GPT2LMHeadModel(config))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _traced_gpt2_matches_one_process(schedule: str) -> None:
    mesh = use_mesh(1, dist.get_world_size())
    first, last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(VOCAB, (BATCH, SEQ), generator=g)

    dense = _gpt2()
    _loss(dense(ids), labels).backward()
    expected = {name: p.grad for name, p in dense.named_parameters()}
    expected["m.lm_head.weight"] = expected["m.transformer.wte.weight"]  # tied

    model = _gpt2()
    split = {f"m.transformer.h.{4 * s // mesh.pp_size}": pipelining.SplitPoint.BEGINNING
             for s in range(1, mesh.pp_size)}  # fmt: skip
    traced = pipelining.pipeline(model, mb_args=(ids[: BATCH // MICROBATCHES],), split_spec=split)
    stage = pipeline.traced_stage(traced, mesh.pp_rank)
    params = {name.removeprefix("module."): p for name, p in stage.named_parameters()}
    tied = [params["m.transformer.wte.weight"]] if first else []
    tied += [params["m.lm_head.weight"]] if last else []
    pipe = pipeline.Pipeline(
        stage, schedule, MICROBATCHES, loss_fn=_loss, mesh=mesh, tied_parameters=tied
    )
    loss = pipe.step(ids if first else None, target=labels if last else None)
    if last:
        assert_close(loss, _loss(dense(ids), labels).detach(), "loss")
    # The tracer leaves the head's module on the first stage too; only the last one uses it.
    unused = {name for name, p in params.items() if p.grad is None}
    assert unused <= (set() if last else {"m.lm_head.weight"}), unused
    for name, p in params.items():
        if name not in unused:
            assert_close(p.grad, expected[name], f"{name} gradient", GRAD_ATOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_traced_hugging_face_gpt2_pipelines_exactly(stages, schedule):
    get_world(stages).run(_traced_gpt2_matches_one_process, schedule)
