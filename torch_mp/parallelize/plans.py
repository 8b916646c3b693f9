"""Ready plans for :func:`torch_mp.parallelize` (Hugging Face's Llama and Mixtral, torchvision's
ResNet block), :func:`prefixed` to place a plan under a prefix, and :func:`default_plan`."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from torch_mp.parallelize.styles import ColwiseParallel, ParallelStyle

Plan = Mapping[str, "ParallelStyle | str"]

# Hugging Face LlamaForCausalLM (and models laid out alike: Mistral, Qwen2): attention heads
# and MLP split, the vocabulary of the embedding split, the head's logits gathered (a loss over
# the whole vocabulary, as the model computes it). Key/value heads must be divisible too.
LLAMA_PLAN: dict[str, ParallelStyle | str] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": ColwiseParallel(gather_output=True),
}

# Hugging Face MixtralForCausalLM: as LLAMA_PLAN's attention and vocabulary over the tensor group,
# and every layer's sparse MoE block with its experts over the expert group (each tensor rank
# runs the block on the same tokens). Needs router_jitter_noise 0 and SiLU experts.
MIXTRAL_PLAN: dict[str, ParallelStyle | str] = {
    **{k: v for k, v in LLAMA_PLAN.items() if ".mlp." not in k},
    "model.layers.*.mlp": "experts",
}

# torchvision's ResNet BasicBlock: conv1's output channels split, bn1 over them, conv2's input
# channels split and its output all-reduced; bn2 and the shortcut whole.
RESNET_BASIC_BLOCK_PLAN: dict[str, ParallelStyle | str] = {
    "conv1": "colwise",
    "bn1": "channel_norm",
    "conv2": "rowwise",
}


def prefixed(prefix: str, plan: Plan) -> dict[str, ParallelStyle | str]:
    """``plan`` for the modules under ``prefix`` (a name or pattern): ``prefixed("layer1.*",
    RESNET_BASIC_BLOCK_PLAN)`` covers every block of a ResNet's layer1."""

    def join(key: str) -> str:
        return ".".join(part for part in (prefix, key) if part)

    return {join(key): style for key, style in plan.items()}


def default_plan(model: nn.Module) -> dict[str, ParallelStyle | str]:
    """Every ``nn.TransformerEncoderLayer`` of ``model`` as a whole parallel layer, and every
    ``nn.MultiheadAttention`` outside them with its heads split."""
    plan: dict[str, ParallelStyle | str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            plan[name] = "transformer_layer"
        elif (
            isinstance(module, nn.MultiheadAttention)
            and not name.endswith("multihead_attn")  # a decoder layer's cross-attention
            and not any(name.startswith(f"{layer}.") or not layer for layer in plan)
        ):
            plan[name] = "attention"
    if not plan:
        raise ValueError(
            f"parallelize: {type(model).__name__} has no nn.TransformerEncoderLayer or "
            "nn.MultiheadAttention; give a plan"
        )
    return plan
