"""Vocab-parallel embedding: the table is split by rows (token ids) across the TP group.

::

    E = [E_0; E_1; ...; E_{n-1}]     rank i holds ids [start_i, stop_i)
    rank i:  Y_i[t] = E_i[id_t - start_i] if id_t is in its range, else 0
    Y = g(sum_i Y_i)                 one all-reduce (a reduce-scatter to sequence shards under SP)

Every id lives on exactly one rank, so the sum is the dense lookup. Ids are checked against the
vocabulary on every rank before any communication: on the host for CPU tensors in eager mode, by a
device-side assert on GPUs and in compiled graphs (no host sync, no graph break:
``runtime/asserts.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.mappings import exit_tp_region
from tensorpar.parallel.sharding import shard_range, sharded_parameter
from tensorpar.runtime.asserts import assert_in_range, checks_on_host
from tensorpar.runtime.groups import tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows split across the TP group.

    num_embeddings, embedding_dim, padding_idx: as ``nn.Embedding`` (the dense table's sizes).
    sequence_parallel: return sequence shards (B, T/n, D) (a reduce-scatter) instead of the full
        (B, T, D) on every rank (an all-reduce).
    group: the TP process group (None: the whole world).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        n = tp_size(group)
        if num_embeddings < n:
            raise ValueError(f"num_embeddings={num_embeddings} cannot be split over {n} ranks")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.group = sequence_parallel, group
        self.vocab_start, self.vocab_stop = shard_range(num_embeddings, n, tp_rank(group))
        # on the meta device nothing is drawn: nn.Embedding's normal_ there would import
        # torch._dynamo (2-3 s of every rank's start with torch 2.13; meta ops run torch._refs)
        empty = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype) \
            if device is not None and torch.device(device).type == "meta" else None
        dense = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype,
                             _weight=empty)
        self.padding_idx = dense.padding_idx
        self.load_dense(dense.weight)

    @classmethod
    def from_dense(
        cls,
        embedding: nn.Embedding,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding``."""
        unsupported = {"max_norm": embedding.max_norm, "sparse": embedding.sparse or None}
        unsupported = {k: v for k, v in unsupported.items() if v is not None}
        if unsupported or embedding.scale_grad_by_freq:
            what = unsupported or "scale_grad_by_freq"
            raise ValueError(f"VocabParallelEmbedding does not support {what}")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                    sequence_parallel, group, device="meta", dtype=embedding.weight.dtype)
        return layer.load_dense(embedding.weight)

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor) -> VocabParallelEmbedding:
        """Take this rank's rows of a dense (num_embeddings, embedding_dim) table."""
        self.weight = sharded_parameter(weight, 0, self.vocab_start, self.vocab_stop)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding: ids must be int32/int64, got {ids.dtype}")
        if ids.numel() and checks_on_host(ids):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(f"VocabParallelEmbedding: ids range over [{low}, {high}], "
                                 f"outside the vocabulary [0, {self.num_embeddings})")
        elif ids.numel():  # a GPU, or compiling: no host sync, no graph break (runtime/asserts)
            assert_in_range(ids, self.num_embeddings, "VocabParallelEmbedding: ids")
        if tp_size(self.group) == 1:
            y = F.embedding(ids, self.weight, self.padding_idx)
        else:
            mine = (ids >= self.vocab_start) & (ids < self.vocab_stop)
            local_ids = torch.where(mine, ids - self.vocab_start, 0)
            pad = self.padding_idx
            local_pad = pad - self.vocab_start if pad is not None and \
                self.vocab_start <= pad < self.vocab_stop else None
            y = F.embedding(local_ids, self.weight, local_pad)
            y = y * mine.unsqueeze(-1).to(y.dtype)  # ids owned elsewhere contribute 0
        return exit_tp_region(y, self.sequence_parallel, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:"
                f"{self.vocab_stop} here), sequence_parallel={self.sequence_parallel}")
