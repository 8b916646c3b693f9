"""torch_mp.parallelize on models the library did not write: nn.TransformerEncoder and
nn.MultiheadAttention (default plan), a Hugging Face Llama built from a small config
(LLAMA_PLAN) and a torchvision ResNet-18 layer (RESNET_BASIC_BLOCK_PLAN): forward outputs equal
the dense model's, and after one SGD step every weight (gathered into the dense model's names)
equals the dense model's after its step, at 2 and 4 ranks.

Tolerances: outputs rtol 1e-5 / atol 1e-5 and weights atol 1e-6 (lr 0.1): the row layers' sums
over ranks are added in another order than one process adds them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from reference import use_mesh
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp import checkpoint
from torch_mp.parallelize import LLAMA_PLAN, RESNET_BASIC_BLOCK_PLAN, LocalAttributes, prefixed

LR = 0.1


def _check_step(dense: nn.Module, plan, inputs, loss_fn) -> None:
    """Parallelizes a copy of ``dense`` by ``plan``, runs both on ``inputs``; compares the
    outputs, then the weights after one SGD step on ``loss_fn(output)``."""
    parallel = torch_mp.parallelize(copy.deepcopy(dense), plan=plan)
    held = sum(p.numel() for p in parallel.parameters())
    assert held < sum(p.numel() for p in dense.parameters()), "nothing was sharded"
    outputs = []
    for model in (dense, parallel):
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        optimizer.zero_grad()
        out = model(*inputs)
        loss_fn(out).backward()
        optimizer.step()
        outputs.append(out.detach() if torch.is_tensor(out) else out)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    expected = dense.state_dict()
    got = checkpoint.dense_state_dict(parallel)
    assert sorted(got) == sorted(expected), set(got) ^ set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def _transformer_encoder(tp: int) -> None:
    use_mesh(tp)
    torch.manual_seed(0)
    for norm_first in (False, True):
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, norm_first=norm_first)
        dense = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        x = torch.randn(6, 3, 32)
        mask = nn.Transformer.generate_square_subsequent_mask(6)
        _check_step(dense, None, (x, mask), lambda y: y.square().mean())
    # "*" crosses dots; a pattern means the outermost modules it matches.
    _check_step(dense, {"layers.*": "transformer_layer"}, (x, mask), lambda y: y.square().mean())


class _Attending(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def _multihead_attention(tp: int) -> None:
    use_mesh(tp)
    torch.manual_seed(1)
    for batch_first in (False, True):
        x = torch.randn(5, 3, 32)
        _check_step(_Attending(batch_first), None, (x,), lambda y: y.square().mean())


def _llama(tp: int) -> None:
    transformers = pytest.importorskip("transformers")
    use_mesh(tp)
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    dense = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (2, 10))
    plan = dict(LLAMA_PLAN)

    class Loss(nn.Module):  # the model's own loss over the whole vocabulary
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    _check_step(Loss(dense), prefixed("model", plan), (ids,), lambda loss: loss)


def _resnet_layer(tp: int) -> None:
    torchvision = pytest.importorskip("torchvision")
    use_mesh(tp)
    torch.manual_seed(3)
    layer = torchvision.models.resnet18().layer1  # two BasicBlocks of 64 channels
    x = torch.randn(2, 64, 8, 8)
    _check_step(layer, prefixed("*", RESNET_BASIC_BLOCK_PLAN), (x,), lambda y: y.square().mean())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    "case", [_transformer_encoder, _multihead_attention, _llama, _resnet_layer]
)
def test_parallelized_model_equals_the_dense_one(case, tp):
    get_world(tp).run(case, tp)


class _Heads(nn.Module):
    """Reshapes by a stored head count, as many attention modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.qkv = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.qkv(x).view(x.shape[0], self.num_heads, -1).softmax(-1)
        return self.proj(h.flatten(1))


def _local_attributes_and_bad_plans(tp: int) -> list[str]:
    use_mesh(tp)
    torch.manual_seed(4)
    plan = {"": LocalAttributes("num_heads"), "qkv": "colwise", "proj": "rowwise"}
    _check_step(_Heads(), plan, (torch.randn(3, 16),), lambda y: y.square().mean())
    errors = []
    tied = _Heads()
    tied.proj.weight = tied.qkv.weight
    for model, bad in (
        (_Heads(), {"nothing.here": "colwise"}),
        (_Heads(), {"qkv": "colwise", "q*": "rowwise"}),
        (_Heads(), {"qkv": "colwise", "proj": "vocab"}),
        (_Heads(), {"qkv": "sideways"}),
        (tied, {"qkv": "colwise"}),
    ):
        try:
            torch_mp.parallelize(model, plan=bad)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
        assert type(model.qkv) is nn.Linear  # refused before anything changed
    dist.barrier()
    return errors


def test_local_attributes_and_plans_that_do_not_fit_are_named(world2):
    [errors] = world2.run(_local_attributes_and_bad_plans, 2)[:1]
    assert "plan entry 'nothing.here' matches no module of _Heads" in errors[0]
    assert "'qkv' is matched by both 'qkv' and 'q*'" in errors[1]
    assert "'proj' (plan entry 'proj'): VocabParallel applies to nn.Embedding" in errors[2]
    assert "unknown style 'sideways'" in errors[3]
    assert "'qkv' shares a parameter with 'proj' (tied weights)" in errors[4]


def _llama_whose_heads_tp_does_not_divide(heads: int, kv_heads: int) -> str | None:
    transformers = pytest.importorskip("transformers")
    use_mesh(2)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,  # (3 and 2 divide it: the heads are what does not fit)
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    try:
        torch_mp.parallelize(model, plan=LLAMA_PLAN)
    except ValueError as e:
        assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # nothing changed
        return str(e)
    return None


@pytest.mark.parametrize(
    "heads, kv_heads, field, fitting",
    [(3, 3, "num_attention_heads (3)", "[1, 3]"), (4, 1, "num_key_value_heads (1)", "[1]")],
    ids=["heads", "grouped-query kv heads"],
)
def test_a_llama_whose_heads_tp_does_not_divide_is_refused_before_any_change(
    heads, kv_heads, field, fitting, world2
):
    for message in world2.run(_llama_whose_heads_tp_does_not_divide, heads, kv_heads):
        assert message is not None, "accepted: the forward would fail inside transformers"
        assert "'model.layers.0.self_attn'" in message and field in message, message
        assert "tensor-parallel size (2)" in message and fitting in message, message


def _parallelize_after_wrapping(wrapper: str) -> str | None:
    transformers = pytest.importorskip("transformers")
    mesh = use_mesh(2)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    if wrapper == "DataParallel":
        torch_mp.DataParallel(model, mesh=mesh)
    else:
        model = DistributedDataParallel(model, process_group=mesh.dp_group)
    try:
        torch_mp.parallelize(model, mesh, plan=LLAMA_PLAN)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("wrapper", ["DataParallel", "DistributedDataParallel"])
def test_parallelize_after_a_data_parallel_wrapper_is_refused(wrapper, world2):
    # (before: accepted, and the new tensor-parallel parameters went un-averaged over the data
    # group, refused only at the step as parameters "without a gradient")
    for message in world2.run(_parallelize_after_wrapping, wrapper):
        assert message is not None and f"already wrapped in {wrapper}" in message, message
        assert "parallelize first, then wrap" in message, message
