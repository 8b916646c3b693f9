"""Vocabulary-parallel embedding and cross-entropy.

The vocabulary (rows of the embedding table, last dim of the logits) is split across the
tensor-parallel group. A vocabulary size the group size does not divide is padded: every rank
holds ``ceil(V / t)`` rows, the rows past ``V`` are zero, never looked up, and get no probability
in :func:`vocab_parallel_cross_entropy`. The math is the C++ core's
(csrc/torch_mp/tensor_parallel/embedding.h, cross_entropy.h), reached as the operator
``torch.ops.torch_mp.vocab_parallel_embedding``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_mp import _C
from torch_mp._group import SharesGroup
from torch_mp._options import DeclaredOptions
from torch_mp.mesh import tp_group_or_default
from torch_mp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401


class VocabParallelEmbedding(
    DeclaredOptions, SharesGroup, nn.Module, declared="VocabParallelEmbedding"
):
    """An ``nn.Embedding`` whose vocabulary is split across the tensor-parallel group.

    Each rank looks up the ids it owns, writes zeros for the others, and the results are summed
    over the group, so every rank gets the embeddings of all ids.

    Args (the options the C++ core declares, csrc/torch_mp/tensor_parallel/embedding.h):
        num_embeddings: Size of the vocabulary; any size (padded to a multiple of the group size).
        embedding_dim: Size of each embedding vector.
        padding_idx: An id whose row is initialised to zero and gets no gradient, as in
            ``nn.Embedding`` (negative values count from the end).
        group: The tensor-parallel group; the default mesh's (``torch_mp.init``) when None.
        device, dtype: Where and in what type to create the table.

    Attributes:
        weight: This rank's ``[ceil(num_embeddings / t), embedding_dim]`` rows.
        vocab_start_index: The first id this rank owns.
        num_embeddings_per_partition: ``ceil(num_embeddings / t)``.

    Raises:
        RuntimeError: If ranks disagree on the arguments, padding_idx is out of range, or (in
            forward) an id is outside ``[0, num_embeddings)``.
    """

    def __init__(self, *args, device=None, dtype=None, **kwargs) -> None:
        super().__init__()
        o = self._take_options(args, kwargs, group=tp_group_or_default)
        self.tp_size = dist.get_world_size(self.group)
        self._check_options(o)
        if self.padding_idx is not None and self.padding_idx < 0:
            self.padding_idx += self.num_embeddings
        start, rows, _ = _C.vocab_range(self.num_embeddings, self.group.group_name)
        self.vocab_start_index = start
        self.num_embeddings_per_partition = rows
        self.weight = nn.Parameter(
            torch.empty(rows, self.embedding_dim, device=device, dtype=dtype)
        )
        self.reset_parameters()
        self._register_layouts()

    def _register_layouts(self) -> None:
        # This rank's rows of the vocabulary; the last ranks' rows past it are padding.
        _C.set_layout(self.weight, 0, self.group.group_name, 1, self.num_embeddings)

    def reset_parameters(self) -> None:
        """Draws this rank's rows of a table initialised exactly as ``nn.Embedding`` does (ranks
        seeded alike hold one table, equal to the ``nn.Embedding`` that seed gives)."""
        _C.init_vocab_parallel_embedding_(
            self.weight, self.num_embeddings, self.padding_idx, self.group.group_name
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_mp.vocab_parallel_embedding(
            input, self.weight, **self._operator_options()
        )

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *args, **kwargs) -> VocabParallelEmbedding:
        """Shards a dense ``nn.Embedding`` (its device and dtype are kept; no random draws);
        ``group`` (by position or keyword) as the constructor's."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError(
                "VocabParallelEmbedding.from_dense: max_norm, scale_grad_by_freq and sparse are "
                "not supported"
            )
        taken = {
            "num_embeddings": embedding.num_embeddings,
            "embedding_dim": embedding.embedding_dim,
            "padding_idx": embedding.padding_idx,
        }
        layer = cls._from_dense(embedding, args, kwargs, taken)
        layer.to_empty(device=embedding.weight.device)
        layer.to(dtype=embedding.weight.dtype)
        layer.load_dense(embedding)
        return layer

    def load_dense(self, embedding: nn.Embedding) -> None:
        """Copies this rank's rows of a dense ``nn.Embedding`` into the table (the padding rows
        past ``num_embeddings`` become zeros)."""
        _C.load_dense_embedding_(self.weight, embedding.weight, self.group.group_name)

    def to_dense(self) -> nn.Embedding:
        """Gathers the table into a dense ``nn.Embedding`` on every rank (a collective)."""
        weight = _C.gather_dense_embedding(self.weight, self.num_embeddings, self.group.group_name)
        return nn.Embedding.from_pretrained(weight, freeze=False, padding_idx=self.padding_idx)
