"""The experts' style of :func:`torch_mp.parallelize` (:class:`ExpertParallel`): a mixture of
experts, a Hugging Face sparse MoE block (Mixtral's) or ``torch_mp.dense.MoE``, with its experts
split over the mesh's expert group."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from torch_mp import _C
from torch_mp import dense as dense_modules
from torch_mp.moe import MoE
from torch_mp.parallelize.styles import ParallelStyle


class _SparseMoeBlock(MoE):
    """A Hugging Face sparse mixture-of-experts block (Mixtral's ``MixtralSparseMoeBlock``: a
    top-k softmax router ``gate`` and SiLU-gated experts stacked in ``experts.gate_up_proj`` /
    ``experts.down_proj``) with its experts split over the expert group, called as the block is:
    ``forward(hidden_states) -> hidden_states``.

    It is a :class:`torch_mp.moe.MoE` with ``activation="swiglu"`` whose router is the block's
    own ``gate`` (replicated): the gate also runs on the tokens as it does in the block, so that
    the model's router-logit recorders, and with them its load-balancing loss
    (``output_router_logits``), see what they see in the one-process model. The module's own
    load-balancing loss of the last call is kept in :attr:`aux_loss`. Checkpoints and
    :meth:`to_dense` use the block's names and form."""

    DENSE_NAMES = {
        "router.": "gate.",
        "experts.fc1_weight": "experts.gate_up_proj",
        "experts.fc2_weight": "experts.down_proj",
    }

    @classmethod
    def from_block(cls, block: nn.Module, group: dist.ProcessGroup) -> _SparseMoeBlock:
        e, rows, h = block.experts.gate_up_proj.shape
        layer = cls(h, rows // 2, e, block.top_k, activation="swiglu", group=group, device="meta")
        weight = block.gate.weight
        layer.to_empty(device=weight.device)
        layer.to(dtype=weight.dtype)
        layer.router = block.gate
        layer._register_layouts()
        # The block's form, for to_dense (a plain attribute: not a submodule), on the meta
        # device without copying its weights first.
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in block.parameters()}
        layer._block_form = (copy.deepcopy(block, memo),)
        layer.aux_loss = None
        layer.load_dense(block)
        return layer

    def reset_parameters(self) -> None:
        raise NotImplementedError(
            "a parallelized Hugging Face MoE block has no initialisation of its own: load its "
            "weights (load_dense, torch_mp.checkpoint)"
        )

    def load_dense(self, block: nn.Module) -> None:
        """Copies ``block``'s gate and this rank's experts into the parameters."""
        local = self.experts.num_experts
        shapes = (tuple(block.experts.gate_up_proj.shape), tuple(block.experts.down_proj.shape))
        want = (
            (local * self.ep_size, *self.experts.fc1_weight.shape[1:]),
            (local * self.ep_size, *self.experts.fc2_weight.shape[1:]),
        )
        if shapes != want:
            raise ValueError(
                f"load_dense: the block's experts are {shapes[0]} and {shapes[1]}, this module's "
                f"dense ones {want[0]} and {want[1]}"
            )
        with torch.no_grad():
            self.router.weight.copy_(block.gate.weight)
            name = self.group.group_name
            self.experts.fc1_weight.copy_(_C.shard(block.experts.gate_up_proj, 0, name))
            self.experts.fc2_weight.copy_(_C.shard(block.experts.down_proj, 0, name))

    def to_dense(self) -> nn.Module:
        """The block, every expert gathered onto every rank (a collective)."""
        moe = super().to_dense()
        weight = self.router.weight
        block = copy.deepcopy(self._block_form[0]).to_empty(device=weight.device)
        block.to(dtype=weight.dtype)
        with torch.no_grad():
            block.gate.weight.copy_(moe.router.weight)
            block.experts.gate_up_proj.copy_(moe.experts.fc1_weight)
            block.experts.down_proj.copy_(moe.experts.fc2_weight)
        return block

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.router(hidden_states.reshape(-1, hidden_states.shape[-1]))  # for the recorders
        y, self.aux_loss = super().forward(hidden_states)
        return y


def _check_sparse_moe_block(module: nn.Module) -> None:
    """Raises unless ``module`` is laid out as Mixtral's sparse MoE block, with nothing that
    one process and the expert group would compute differently."""
    name = type(module).__name__
    parameters = {n: p for n, p in module.named_parameters()}
    if (
        set(dict(module.named_children())) != {"gate", "experts"}
        or set(parameters) != {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
        or any(True for _ in module.buffers())
        or not isinstance(getattr(module, "top_k", None), int)
    ):
        raise TypeError(
            "ExpertParallel applies to torch_mp.dense.MoE and to Hugging Face sparse MoE blocks "
            "laid out as Mixtral's (gate.weight [E, h], experts.gate_up_proj [E, 2f, h], "
            f"experts.down_proj [E, h, f] and top_k, nothing else), not {name} (whose "
            f"parameters are {sorted(parameters)})"
        )
    gate, experts = module.gate, module.experts
    if len({p.dtype for p in parameters.values()}) > 1:
        raise ValueError(f"ExpertParallel: {name}'s gate and experts differ in dtype")
    # The gate must route as Mixtral's: softmax in fp32, the top k, renormalised.
    weight = gate.weight
    probe = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight)
    with torch.no_grad():
        routed = gate(probe)
        top, chosen = F.linear(probe, weight).float().softmax(-1).topk(module.top_k, -1)
    if not (
        isinstance(routed, tuple)
        and len(routed) == 3
        and torch.equal(routed[2], chosen)
        and torch.allclose(routed[1].float(), top / top.sum(-1, keepdim=True))
    ):
        raise ValueError(
            f"ExpertParallel: {name}'s gate does not route as Mixtral's (softmax over the "
            "experts, the top k renormalised, returned as (logits, weights, indices))"
        )
    probe = torch.linspace(-3, 3, 7)
    act = getattr(experts, "act_fn", None)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(
            f"ExpertParallel: {type(module).__name__}'s experts must be SiLU-gated "
            "(hidden_act 'silu')"
        )
    if getattr(module, "jitter_noise", 0) > 0:
        raise ValueError(
            f"ExpertParallel: router_jitter_noise = {module.jitter_noise} draws noise for every "
            "token, which the expert group's ranks cannot draw as one process does; set it to 0"
        )


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    """A mixture of experts with its experts split over the mesh's expert group (rank e of the
    group holding experts ``[e E / ep, (e + 1) E / ep)``, the router replicated): a Hugging Face
    sparse MoE block laid out as Mixtral's becomes the same block, called as it is
    (SiLU-gated experts; router jitter refused); a :class:`torch_mp.dense.MoE` becomes
    :class:`torch_mp.moe.MoE`. Each rank routes its own tokens: the experts' gradients gather
    the tokens of the whole expert group, the router's are this rank's (reduce both with
    :class:`torch_mp.DataParallel`, which knows the experts' group)."""

    GROUP = "ep_group"

    def check(self, module, group):
        if group is None:
            raise ValueError(
                "ExpertParallel needs a mesh with an expert group (torch_mp.init(..., ep=N))"
            )
        if isinstance(module, dense_modules.MoE):
            experts = module.num_experts
        else:
            _check_sparse_moe_block(module)
            experts = module.experts.gate_up_proj.shape[0]
        if experts % dist.get_world_size(group):
            raise ValueError(
                f"{experts} experts cannot be split over an expert group of "
                f"{dist.get_world_size(group)} ranks"
            )

    def apply(self, module, group):
        if isinstance(module, dense_modules.MoE):
            return MoE.from_dense(module, group)
        return _SparseMoeBlock.from_block(module, group)
