"""Context parallelism: long sequences split across the ranks of a context group, each holding
a part of every sequence, with attention over the whole sequence computed from the parts.

- :func:`shard_sequence` / :func:`unshard_sequence`: a whole sequence to this rank's part and
  back (autograd-aware, as ``scatter_to_tp`` / ``gather_from_tp``); load-balanced for causal
  masks by default: the sequence cut into 2 * cp chunks, rank r holding chunks r and
  2 * cp - 1 - r. :func:`sequence_positions` says which positions a rank holds (for rotary or
  learned position embeddings).
- :func:`attention`: this rank's part of attention over the whole sequence, by a ring of K/V
  blocks (``"ring"``), an all-gather of K/V (``"all_gather"``) or Ulysses' all-to-alls
  (``"all_to_all"``).

The C++ core holds all of it (``csrc/torch_mp/context_parallel/``); these are its operators.
"""

from torch_mp.context_parallel.attention import METHODS, attention
from torch_mp.context_parallel.sharding import sequence_positions, shard_sequence, unshard_sequence

__all__ = ["METHODS", "attention", "sequence_positions", "shard_sequence", "unshard_sequence"]
