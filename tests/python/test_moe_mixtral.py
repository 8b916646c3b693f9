"""A Hugging Face Mixtral through torch_mp.parallelize (MIXTRAL_PLAN: attention over the tensor
group, the sparse MoE blocks' experts over the expert group) against the dense model, in fp32
and a block in bf16; and the blocks it cannot split exactly, refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import assert_close, error_of, rank_tensor, use_mesh

import torch_mp

# Sums over tokens taken in another order (an expert's tokens from several ranks): atol 1e-5 for
# entries near zero, rtol 1e-5.
GRAD_ATOL = 1e-5


def _mixtral(tp: int, ep: int) -> None:
    transformers = pytest.importorskip("transformers")
    from torch_mp import checkpoint
    from torch_mp.parallelize import MIXTRAL_PLAN

    mesh = use_mesh(tp, 1, 1, ep)
    torch.manual_seed(3)
    config = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        output_router_logits=True,  # the model's load-balancing loss joins its loss
        router_aux_loss_coef=0.02,
        attn_implementation="eager",
    )
    reference = transformers.MixtralForCausalLM(config)
    parallel = torch_mp.parallelize(copy.deepcopy(reference), plan=MIXTRAL_PLAN)
    blocks = [m for m in parallel.modules() if isinstance(m, torch_mp.moe.MoE)]
    assert len(blocks) == 2 and all(b.experts.num_experts == 4 // ep for b in blocks)
    trained = torch_mp.DataParallel(parallel)  # the router over the data group, experts not

    # Each data rank its own batch; the one-process model the mean of their losses.
    def batch(d):
        return torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(10 + d))

    losses = [reference(input_ids=batch(d), labels=batch(d)).loss for d in range(mesh.dp_size)]
    (sum(losses) / len(losses)).backward()
    mine = batch(mesh.dp_rank)
    loss = trained(input_ids=mine, labels=mine).loss
    assert_close(loss, losses[mesh.dp_rank].detach(), "loss (with the load-balancing loss)")
    loss.backward()
    for model in (reference, parallel):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    expected = reference.state_dict()
    got = checkpoint.dense_state_dict(parallel)  # the block's own names, experts gathered
    assert sorted(got) == sorted(expected), set(got) ^ set(expected)
    for name, value in expected.items():
        assert_close(got[name], value, f"{name} after a step", GRAD_ATOL)


@pytest.mark.parametrize(
    "tp, ep, world",
    [(1, 2, 2), (1, 4, 4), (1, 2, 4), (2, 2, 4)],
    ids=["ep2", "ep4", "dp4-ep2", "tp2-ep2"],
)
def test_a_mixtral_through_parallelize_equals_the_dense_model(tp, ep, world):
    get_world(world).run(_mixtral, tp, ep)


def _mixtral_refusals() -> dict[str, str | None]:
    transformers = pytest.importorskip("transformers")
    from torch_mp.parallelize import MIXTRAL_PLAN

    use_mesh(1, 1, 1, 2)
    out = {}
    for name, change in {
        "jitter": {"router_jitter_noise": 0.1},
        "gelu": {"hidden_act": "gelu"},
        "3 experts": {"num_local_experts": 3},
    }.items():
        sizes = {
            "vocab_size": 32,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
        }
        config = transformers.MixtralConfig(**{**sizes, **change})
        out[name] = error_of(
            lambda config=config: torch_mp.parallelize(
                transformers.MixtralForCausalLM(config), plan=MIXTRAL_PLAN
            )
        )
    return out


def test_parallelize_refuses_mixtral_blocks_it_cannot_split_exactly():
    for errors in get_world(2).run(_mixtral_refusals):
        assert "router_jitter_noise = 0.1" in errors["jitter"], errors
        assert "must be SiLU-gated" in errors["gelu"], errors
        assert "3 experts cannot be split over an expert group of 2" in errors["3 experts"], errors


def _mixtral_block_in_bf16(ep: int) -> float:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from torch_mp.parallelize import ExpertParallel

    mesh = use_mesh(1, 1, 1, ep)
    torch.manual_seed(4)
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4)
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(std=0.3)
    block = block.to(torch.bfloat16)
    parallel = ExpertParallel().apply(copy.deepcopy(block), mesh.ep_group)
    x = rank_tensor(5, dist.get_rank(), 2, 6, 16).to(torch.bfloat16)
    y, want = parallel(x), block(x)
    # Routed in fp32 as the block routes (the same experts); the experts' products are bf16
    # kernels of their own.
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    return (y.float() - want.float()).abs().max().item()


def test_a_mixtral_block_in_bf16_routes_as_the_block_does():
    get_world(2).run(_mixtral_block_in_bf16, 2)


def _not_mixtral() -> str:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from torch_mp.parallelize import ExpertParallel

    mesh = use_mesh(1, 1, 1, 2)
    block = MixtralSparseMoeBlock(transformers.MixtralConfig(hidden_size=8, num_local_experts=4))
    block.shared_expert = torch.nn.Linear(8, 8)  # as Qwen2-MoE's: not Mixtral's layout
    try:
        ExpertParallel().check(block, mesh.ep_group)
    except TypeError as error:
        return str(error)
    return "no error"


def test_expert_parallel_refuses_blocks_not_laid_out_as_mixtrals():
    for error in get_world(2).run(_not_mixtral):
        assert "laid out as Mixtral's" in error and "shared_expert.weight" in error, error
