"""Where every parameter of a sharded model lives across the TP group, and what that is used for.

``Layout.gather(model, group)`` collects each rank's ``param.tp_shard`` once (one
``all_gather_object`` at setup). From it, every rank knows which dense slice it *owns*: its own
slice minus what a lower rank already holds. Ownership makes each dense element count once, even
where ranks hold copies (replicated norms, KV heads shared when there are fewer KV heads than
ranks). It is what the global gradient norm sums and what a checkpoint stores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.sharding import REPLICATED, ShardSpec, dense_shape
from tensorpar.runtime.groups import tp_rank, tp_size


@dataclass(frozen=True)
class Layout:
    """shapes[name]: the dense shape; shards[name][r]: rank r's ShardSpec of it."""

    shapes: dict[str, tuple[int, ...]]
    shards: dict[str, list[ShardSpec]]

    @classmethod
    def gather(cls, model: nn.Module, group: ProcessGroup | None = None) -> Layout:
        mine = {name: getattr(p, "tp_shard", REPLICATED) for name, p in model.named_parameters()}
        shapes = {name: dense_shape(p) for name, p in model.named_parameters()}
        every = [mine]
        if tp_size(group) > 1:
            every = [None] * tp_size(group)
            dist.all_gather_object(every, mine, group=group)
        for r, theirs in enumerate(every):
            if theirs.keys() != mine.keys():
                raise ValueError(f"rank {r} has different parameters than rank {tp_rank(group)}: "
                                 f"{sorted(theirs.keys() ^ mine.keys())[:5]}")
        return cls(shapes, {name: [theirs[name] for theirs in every] for name in mine})

    def owned(self, name: str, rank: int) -> tuple[int, int] | None:
        """The dense range [start, stop) of the split dim that ``rank`` owns, or None if it owns
        nothing of ``name``. A replicated parameter is owned whole by rank 0: (0, 0) with dim None.
        """
        spec = self.shards[name][rank]
        if spec.dim is None:
            return (0, 0) if rank == 0 else None
        start = max([spec.start] + [s.stop for s in self.shards[name][:rank] if s.stop > spec.start
                                    and s.start <= spec.start])
        return (start, spec.stop) if start < spec.stop else None

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])


def owned_local(layout: Layout, name: str, t: torch.Tensor, rank: int) -> torch.Tensor | None:
    """The part of ``t`` (this rank's local shard of ``name``, or a same-shaped gradient or
    optimizer state) that ``rank`` owns, or None."""
    owned = layout.owned(name, rank)
    spec = layout.shards[name][rank]
    if owned is None or spec.dim is None:
        return None if owned is None else t
    return t.narrow(spec.dim, owned[0] - spec.start, owned[1] - owned[0])


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, layout: Layout, max_norm: float,
                    group: ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so the global L2 norm (of the dense model) is at most ``max_norm``.

    Each rank sums the squares of the gradient elements it owns; one all-reduce of that scalar
    gives the dense norm on every rank (replicated and shared parameters counted once).
    Returns the norm before clipping, the same on every rank.
    """
    rank = tp_rank(group)
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    device = grads[0][1].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for name, g in grads:
        owned = owned_local(layout, name, g, rank)
        if owned is not None:
            sq += owned.float().pow(2).sum()
    if tp_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for _, g in grads:
            g.mul_(scale.to(g.dtype))
    return norm


def rank_sizes(model: nn.Module, layout: Layout) -> dict[str, int]:
    """Elements this rank holds, and the dense model's element count."""
    local = sum(p.numel() for p in model.parameters())
    dense = sum(layout.numel(name) for name in layout.shapes)
    return {"local": local, "dense": dense}
