"""A small GPT, defined once: the one-process model (:class:`DenseGPT`) and its tensor-parallel
pipeline stages (:class:`GPTStage`), sharded from it.

The model: token and learned position embeddings, pre-LN transformer layers under a causal mask,
a final LayerNorm and an output head tied to the token embedding, on ``[b, s]`` token ids,
giving ``[s, b, vocab]`` logits. The C++ examples define the same model, corpus and batches
(csrc/torch_mp/models/gpt.h), with the same parameter names, so checkpoints cross the front ends.

In the stages, the vocabulary (embedding rows, logits, loss), the attention heads and the MLP are
split across the tensor group; with ``sequence_parallel`` the LayerNorms and residuals act on
each rank's chunk of the sequence. With a ``context_group`` each rank of the context group holds
its part of every sequence (load-balanced, :func:`torch_mp.context_parallel.shard_sequence`) from
the embeddings to the loss, which is the mean over the whole sequence. The first stage holds the
embeddings, the last the final norm and the head, a copy of the embedding tied to it across the
pipeline (or the embedding itself when one stage holds both).

With ``GPTConfig.moe_experts`` every layer's MLP is a mixture of experts (:class:`MoELayer`,
:class:`torch_mp.dense.MoE`), its experts spread over the mesh's expert group in the stages
(:class:`ParallelMoELayer`, :class:`torch_mp.moe.MoE`). The layers' load-balancing losses travel
with the activations from stage to stage and join the loss at the end.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import torch_mp
from torch_mp import context_parallel, functional
from torch_mp._group import SharesGroup

__all__ = [
    "Corpus",
    "DenseGPT",
    "GPTConfig",
    "GPTStage",
    "MoELayer",
    "ParallelMoELayer",
    "build_stages",
    "dense_loss",
    "gpt2_init_std",
    "sample",
]

#: The corpus the examples train on: Shakespeare's plays (public domain), the first 300 KB of
#: the "tiny Shakespeare" collection.
SHAKESPEARE = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
#: GPT-2's standard deviation for the weights of every table and projection.
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """The GPT's sizes. ``heads`` and ``ffn`` (and ``seq`` under sequence parallelism) must be
    divisible by the tensor-parallel size; the vocabulary need not be. With ``moe_experts``
    every layer is a :class:`MoELayer` of that many experts of ``ffn`` each, ``moe_top_k`` of
    them per token (``moe_experts`` divisible by the expert-parallel size)."""

    vocab: int
    seq: int = 32
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 4
    moe_experts: int = 0
    moe_top_k: int = 2


class Corpus:
    """The bytes of a text file as token ids (its distinct bytes, in order, numbered from 0),
    cut into random windows, the same on every rank for the same step (and in C++)."""

    def __init__(self, path: Path | str = SHAKESPEARE) -> None:
        data = Path(path).read_bytes()
        self.alphabet = sorted(set(data))
        index = {b: i for i, b in enumerate(self.alphabet)}
        self.ids = torch.tensor([index[b] for b in data], dtype=torch.long)

    @property
    def vocab(self) -> int:
        return len(self.alphabet)

    def decode(self, ids) -> str:
        """Token ids back to text (bytes that do not form UTF-8 shown as U+FFFD)."""
        return bytes(self.alphabet[i] for i in ids).decode("utf-8", errors="replace")

    def batch(self, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` windows for ``step``: inputs and next-token targets, each ``[batch, seq]``."""
        g = torch.Generator().manual_seed(1000 + step)
        starts = torch.randint(len(self.ids) - seq - 1, (batch,), generator=g)
        windows = torch.stack([self.ids[s : s + seq + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


def gpt2_init_std(name: str, layers: int) -> float | None:
    """GPT-2's initial standard deviation of the parameter ``name`` of a ``layers``-layer
    :class:`DenseGPT`: 0.02 for the tables and projections, ``0.02 / sqrt(2 * layers)`` for the
    projections that end a residual branch (``self_attn.out_proj``, ``linear2`` or the experts'
    ``moe.experts.fc2_weight``: the residual stream sums ``2 * layers`` of them), None for the
    LayerNorms (weight 1, bias 0)."""
    if "norm" in name:
        return None
    if name.endswith(("self_attn.out_proj.weight", "linear2.weight", "experts.fc2_weight")):
        return INIT_STD / math.sqrt(2 * layers)
    return INIT_STD


class MoELayer(nn.Module):
    """A pre-LN transformer layer whose MLP is a mixture of experts, without biases:
    ``x + attn(norm1(x))``, then ``+ moe(norm2(x))`` (:class:`torch_mp.dense.MoE`, gelu
    experts, softmax router). ``forward(x, mask)`` on ``[s, b, h]`` returns ``(x, aux_loss)``:
    the load-balancing loss of the layer's ``s * b`` tokens."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.self_attn = nn.MultiheadAttention(h, config.heads, bias=False)
        self.norm1 = nn.LayerNorm(h, bias=False)
        self.norm2 = nn.LayerNorm(h, bias=False)
        self.moe = torch_mp.dense.MoE(h, config.ffn, config.moe_experts, config.moe_top_k)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        y, aux_loss = self.moe(self.norm2(x))
        return x + y, aux_loss


class DenseGPT(nn.Module):
    """The one-process model, on ``[b, s]`` token ids; returns ``[s, b, vocab]`` logits (and,
    with ``with_aux_loss``, the sum of the MoE layers' load-balancing losses, 0 without them).

    The transformer layers have no biases (as in PaLM or LLaMA). With them, the attention's key
    bias would have a gradient that is exactly zero in exact arithmetic (softmax ignores a
    constant added to a row of scores) and rounding noise of ~1e-10 in practice, which AdamW
    turns into updates of lr * noise / eps: noise that no two summation orders share.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Embedding(config.seq, config.hidden)
        self.layers = nn.ModuleList(
            MoELayer(config)
            if config.moe_experts
            else nn.TransformerEncoderLayer(
                config.hidden,
                config.heads,
                config.ffn,
                dropout=0.0,
                activation="gelu",
                norm_first=True,
                bias=False,
            )
            for _ in range(config.layers)
        )
        self.norm = nn.LayerNorm(config.hidden)
        with torch.no_grad():  # GPT-2's initialisation
            for name, parameter in self.named_parameters():
                std = gpt2_init_std(name, config.layers)
                if std is not None:
                    parameter.normal_(std=std)

    def forward(
        self, tokens: torch.Tensor, with_aux_loss: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        tokens = tokens.T  # [s, b]
        s = tokens.shape[0]
        x = self.tok(tokens) + self.pos(torch.arange(s))[:, None]
        mask = nn.Transformer.generate_square_subsequent_mask(s)
        aux_loss = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            if isinstance(layer, MoELayer):
                x, layer_aux = layer(x, mask)
                aux_loss = aux_loss + layer_aux
            else:
                x = layer(x, src_mask=mask, is_causal=True)
        logits = self.norm(x) @ self.tok.weight.T
        return (logits, aux_loss) if with_aux_loss else logits


@torch.no_grad()
def sample(
    model: DenseGPT,
    prompt: torch.Tensor,
    length: int,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``prompt`` (``[b, s0]`` token ids) continued by ``length`` tokens, each drawn from the
    softmax of the model's last logits divided by ``temperature`` (the most likely token when it
    is 0), the model seeing the last ``config.seq`` tokens. Returns ``[b, s0 + length]`` ids."""
    ids = prompt
    for _ in range(length):
        logits = model(ids[:, -model.config.seq :])[-1]  # [b, vocab]
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            probabilities = torch.softmax(logits / temperature, -1)
            token = torch.multinomial(probabilities, 1, generator=generator)[:, 0]
        ids = torch.cat([ids, token[:, None]], 1)
    return ids


def dense_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``[s, b, vocab]`` logits against ``[b, s]`` next-token targets (in
    fp32 whatever the logits' dtype, as large runs take it)."""
    return F.cross_entropy(logits.float().flatten(0, 1), target.T.flatten())


class ParallelMoELayer(SharesGroup, nn.Module):
    """:class:`MoELayer` sharded: the attention heads over the tensor group
    (:class:`torch_mp.ParallelSelfAttention`), the experts over the expert group
    (:class:`torch_mp.moe.MoE`). Every rank of the tensor group runs the mixture on the whole
    ``[s, b, h]`` (the same tokens, the same experts), so its parameters are replicated over
    the tensor group and their gradients are the dense ones on each rank.
    ``forward(x, is_causal=True)`` returns ``(x, aux_loss)`` as the dense layer does."""

    def __init__(
        self,
        dense: MoELayer,
        group: dist.ProcessGroup | None = None,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = torch_mp.ParallelSelfAttention.from_dense(dense.self_attn, group)
        self.norm1 = torch_mp.tensor_parallel.LayerNorm.from_dense(dense.norm1, group=group)
        self.norm2 = torch_mp.tensor_parallel.LayerNorm.from_dense(dense.norm2, group=group)
        self.moe = torch_mp.moe.MoE.from_dense(dense.moe, group=expert_group)

    def forward(self, x: torch.Tensor, is_causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.norm1(x), is_causal=is_causal)
        y, aux_loss = self.moe(self.norm2(x))
        return x + y, aux_loss


class GPTStage(SharesGroup, nn.Module):
    """One pipeline stage of ``DenseGPT``, tensor-parallel: layers ``layers`` of the dense model,
    plus the embeddings on the first stage and the final norm and (tied) head on the last.

    The first stage takes ``[b, s]`` token ids; stages pass ``[s, b, h]`` activations
    (``[s / t, b, h]`` under sequence parallelism); the last returns this rank's
    ``[s, b, ceil(vocab / t)]`` slice of the logits, for :meth:`loss`. With a
    ``context_group`` the first stage keeps this rank's part of the tokens (and of the
    positions), so that ``s`` above is the part's ``s / cp``; :meth:`loss` takes the whole
    targets and keeps the same part.

    Its layers are split over ``group``, the tensor-parallel group (the default mesh's when
    None). With MoE layers (``dense.config.moe_experts``; their experts over ``expert_group``,
    the default mesh's ``ep_group`` when None) every stage also returns the sum of the
    load-balancing losses so far, ``[1]``, and the stages after the first take it as their
    second input: ``(x, aux_loss)`` in and out, ``loss(logits, aux_loss, target)`` at the end.
    Sequence and context parallelism and recomputation are refused with them.
    """

    def __init__(
        self,
        dense: DenseGPT,
        layers: range,
        first: bool,
        last: bool,
        sequence_parallel: bool = False,
        recompute: str | None = None,
        context_group: dist.ProcessGroup | None = None,
        context_method: str = "ring",
        expert_group: dist.ProcessGroup | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.first, self.last, self.sequence_parallel = first, last, sequence_parallel
        self.context_group = context_group
        self.vocab = dense.config.vocab
        self.layer_ids = layers
        self.moe = dense.config.moe_experts > 0
        if self.moe:
            refused = {
                "sequence parallelism": sequence_parallel,
                "context parallelism": context_group is not None,
                f"recompute={recompute!r}": recompute is not None,
            }
            for setting, given in refused.items():
                if given:
                    raise ValueError(f"GPTStage: MoE layers do not support {setting} yet")
        if first:
            self.tok = torch_mp.VocabParallelEmbedding.from_dense(dense.tok, group)
            self.pos = copy.deepcopy(dense.pos)  # replicated on every rank
        self.layers = nn.ModuleList(
            ParallelMoELayer(dense.layers[i], group, expert_group=expert_group)
            if self.moe
            else torch_mp.ParallelTransformerLayer.from_dense(
                dense.layers[i],
                group,
                sequence_parallel=sequence_parallel,
                recompute=recompute,
                context_parallel=context_group is not None,
                context_group=context_group,
                context_method=context_method,
            )
            for i in layers
        )
        if last:
            self.norm = torch_mp.tensor_parallel.LayerNorm.from_dense(
                dense.norm, sequence_parallel=sequence_parallel, group=group
            )
            # One stage holds both ends: the head is the embedding itself. Otherwise a copy,
            # tied to the first stage's through Pipeline(tied_parameters=...).
            self.head = (
                self.tok if first else torch_mp.VocabParallelEmbedding.from_dense(dense.tok, group)
            )

    def forward(
        self, x: torch.Tensor, aux_loss: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.moe and self.first:
            # (One element, not a scalar: the pipeline joins micro-batches' outputs by
            # concatenation.)
            aux_loss = torch.zeros(1, device=x.device)
        if self.first:
            tokens = x.T
            positions = torch.arange(tokens.shape[0])
            if self.context_group is not None:  # this rank's part, from here to the loss
                group = self.context_group
                positions = context_parallel.sequence_positions(tokens.shape[0], group=group)
                tokens = context_parallel.shard_sequence(tokens, 0, group=group)
            # Every rank computes the whole embedding (the vocab-parallel lookup all-reduces).
            x = self.tok(tokens) + self.pos(positions)[:, None]
            if self.sequence_parallel:
                # This rank's chunk of the sequence; scatter_to_tp (not a plain chunk) gives the
                # tables the whole sequence's gradient (its backward all-gathers).
                x = functional.scatter_to_tp(x, group=self.group, dim=0)
        for layer in self.layers:
            if self.moe:
                x, layer_aux = layer(x, is_causal=True)
                aux_loss = aux_loss + layer_aux
            else:
                x = layer(x, is_causal=True)
        if self.last:
            h = self.norm(x)
            # Into the vocab-parallel head: under sequence parallelism gather the sequence back
            # (backward reduce-scatters), otherwise copy_to_tp (backward all-reduces).
            h = (
                functional.gather_from_sp(h, group=self.group)
                if self.sequence_parallel
                else functional.copy_to_tp(h, group=self.group)
            )
            x = h @ self.head.weight.T
        return (x, aux_loss) if self.moe else x

    def loss(self, logits: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, ``loss(logits, target)`` (with MoE layers
        ``loss(logits, aux_loss, target)``, the load-balancing losses added):
        vocabulary-parallel cross-entropy against ``[b, s]`` targets (in fp32 whatever the
        logits' dtype); under context parallelism this rank's part of them, the mean taken over
        the context group's tokens."""
        *aux_loss, target = rest
        if len(aux_loss) != int(self.moe):
            raise TypeError(
                "GPTStage.loss takes (logits, aux_loss, target) with MoE layers, "
                "(logits, target) without"
            )
        target = target.T
        if self.context_group is not None:
            target = context_parallel.shard_sequence(target, 0, group=self.context_group)
        loss = torch_mp.vocab_parallel_cross_entropy(
            logits.float(),
            target,
            group=self.group,
            vocab_size=self.vocab,
            context_parallel=self.context_group is not None,
            context_group=self.context_group,
        )
        return loss + aux_loss[0].float().sum() if aux_loss else loss

    def dense_names(self) -> dict[str, str]:
        """How this stage's names map to ``DenseGPT``'s, for torch_mp.checkpoint: its layers
        renumbered, and the head, tied to the embedding, to the embedding's name."""
        names = {f"layers.{j}.": f"layers.{i}." for j, i in enumerate(self.layer_ids)}
        names["head.weight"] = "tok.weight"
        return names

    def gathered(self) -> dict[str, torch.Tensor]:
        """This stage's parameters gathered into ``DenseGPT``'s names (a tensor-group
        collective); a head that is a copy of the embedding as ``head.weight``."""
        names = self.dense_names()
        del names["head.weight"]
        return torch_mp.checkpoint.dense_state_dict(self, names)


def build_stages(
    dense: DenseGPT,
    mesh: torch_mp.Mesh,
    stages_per_rank: int = 1,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    context_method: str = "ring",
) -> list[GPTStage]:
    """This rank's stages (``mesh.pp_rank``, ``+ pp``, ...) of ``dense`` cut into
    ``pp * stages_per_rank`` stages of equal numbers of layers; ``recompute`` the layers'
    activation recomputation (None, ``"full"`` or ``"selective"``). With a context group
    (``mesh.cp_size > 1``) the stages are context-parallel, their attention by
    ``context_method``; with MoE layers, their experts over ``mesh.ep_group``."""
    num_stages = mesh.pp_size * stages_per_rank
    layers = len(dense.layers)
    if layers % num_stages:
        raise torch_mp.LayoutError(f"{layers} layers cannot be cut into {num_stages} equal stages")
    per_stage = layers // num_stages
    return [
        GPTStage(
            dense,
            range(s * per_stage, (s + 1) * per_stage),
            first=s == 0,
            last=s == num_stages - 1,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            context_group=mesh.cp_group if mesh.cp_size > 1 else None,
            context_method=context_method,
            expert_group=mesh.ep_group if dense.config.moe_experts else None,
            group=mesh.tp_group,
        )
        for s in range(mesh.pp_rank, num_stages, mesh.pp_size)
    ]
