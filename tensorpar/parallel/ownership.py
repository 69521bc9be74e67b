"""Where every parameter of a sharded model lives across the TP group, and what that is used for.

``ShardOwnership.gather(model, group)`` collects each rank's ``param_shard`` once (one
``all_gather_object`` at setup). From it, every rank knows which dense slice it *owns*: its own
slice minus what a lower rank already holds. Ownership makes each dense element count once, even
where ranks hold copies (replicated norms, KV heads shared when there are fewer KV heads than
ranks). It is what the global gradient norm sums and what a checkpoint stores. Routed experts
(``ep_shard``) are split like a TP dim: TP ranks that hold different experts each own theirs,
TP ranks that hold the same ones own them once.

A fused dimension (``ShardSpec.parts`` = P equal blocks of size B, GPT-2's q|k|v) is split block
by block: a rank holds [start, stop) of every block, so it owns [s, e) (computed within a block,
as for an unfused dim) of every block, the dense ranges [i·B + s, i·B + e) for i < P.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.sharding import ShardSpec, dense_shape, is_expert_split, param_shard
from tensorpar.parallel.stages import is_stage_copy
from tensorpar.runtime.dtensors import is_dtensor, local_part
from tensorpar.runtime.groups import tp_rank, tp_size


@dataclass(frozen=True)
class ShardOwnership:
    """Which rank owns which slice of each parameter. shapes[name]: the dense shape;
    shards[name][r]: rank r's ShardSpec of it."""

    shapes: dict[str, tuple[int, ...]]
    shards: dict[str, list[ShardSpec]]

    @classmethod
    def gather(cls, model: nn.Module, group: ProcessGroup | None = None) -> ShardOwnership:
        mine = {name: param_shard(p) for name, p in model.named_parameters()}
        shapes = {name: dense_shape(p) for name, p in model.named_parameters()}
        every = [mine]
        if tp_size(group) > 1:
            every = [None] * tp_size(group)
            dist.all_gather_object(every, mine, group=group)
        for r, theirs in enumerate(every):
            if theirs.keys() != mine.keys():
                raise ValueError(f"rank {r} has different parameters than rank {tp_rank(group)}: "
                                 f"{sorted(theirs.keys() ^ mine.keys())[:5]}")
        for name in mine:  # ownership compares ranges within one cut into blocks
            cuts = [(theirs[name].dim, theirs[name].full_size, theirs[name].parts)
                    for theirs in every]
            if len(set(cuts)) > 1:
                raise ValueError(f"the ranks split {name} differently (dim, dense size, blocks "
                                 f"by rank): {cuts}")
        return cls(shapes, {name: [theirs[name] for theirs in every] for name in mine})

    def owned(self, name: str, rank: int) -> tuple[int, int] | None:
        """The range [start, stop) of the split dim that ``rank`` owns *within each block*
        (the dense range itself when ``parts`` is 1), or None if it owns nothing of ``name``.
        A replicated parameter is owned whole by rank 0: (0, 0) with dim None.
        """
        spec = self.shards[name][rank]
        if spec.dim is None:
            return (0, 0) if rank == 0 else None
        start = max([spec.start] + [s.stop for s in self.shards[name][:rank] if s.stop > spec.start
                                    and s.start <= spec.start])
        return (start, spec.stop) if start < spec.stop else None

    def owned_ranges(self, name: str, rank: int) -> list[tuple[int, int]]:
        """The dense ranges of the split dim that ``rank`` owns, one per block, in the order its
        local tensor holds them ([] if none). Replicated: [(0, 0)] on rank 0 (the whole tensor)."""
        owned, spec = self.owned(name, rank), self.shards[name][rank]
        if owned is None or spec.dim is None:
            return [] if owned is None else [owned]
        block = spec.full_size // spec.parts
        return [(i * block + owned[0], i * block + owned[1]) for i in range(spec.parts)]

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])


def owned_pieces(ownership: ShardOwnership, name: str, t: torch.Tensor,
                 rank: int) -> list[torch.Tensor]:
    """Views of the parts of ``t`` (this rank's local shard of ``name``, or a same-shaped gradient
    or optimizer state) that ``rank`` owns, one per dense range of ``owned_ranges``.

    The local tensor stacks the P blocks' slices, each ``stop - start`` long along ``dim``: block
    i's owned range [s, e) sits at local offset i·(stop - start) + (s - start)."""
    owned, spec = ownership.owned(name, rank), ownership.shards[name][rank]
    if owned is None or spec.dim is None:
        return [] if owned is None else [t]
    width = spec.stop - spec.start
    return [t.narrow(spec.dim, i * width + owned[0] - spec.start, owned[1] - owned[0])
            for i in range(spec.parts)]


def owned_local(ownership: ShardOwnership, name: str, t: torch.Tensor,
                rank: int) -> torch.Tensor | None:
    """The part of ``t`` that ``rank`` owns (``owned_pieces`` concatenated along the split dim,
    in the order of ``owned_ranges``), or None."""
    pieces = owned_pieces(ownership, name, t, rank)
    if len(pieces) <= 1:
        return pieces[0] if pieces else None
    return torch.cat(pieces, dim=ownership.shards[name][rank].dim)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, ownership: ShardOwnership, max_norm: float,
                    group: ProcessGroup | None = None,
                    dp_group: ProcessGroup | None = None,
                    pp_group: ProcessGroup | None = None,
                    ep_group: ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so the global L2 norm (of the dense model) is at most ``max_norm``.

    Each rank sums the squares of the gradient elements it owns; one all-reduce of that scalar
    gives the dense norm on every rank (replicated and shared parameters counted once).
    Returns the norm before clipping, the same on every rank. A norm that is not finite leaves
    the gradients as they are (the caller decides: the trainer skips or stops), without a host
    sync.

    dp_group: with FSDP2 (gradients that are DTensors, split once more over data parallelism)
    each rank holds 1/dp of its TP shard's gradient, so the sum is all-reduced over ``dp_group``
    too. DDP's gradients are whole (the same on every dp rank): no second all-reduce.
    pp_group: with pipeline stages, each rank holds its stages' parameters alone, so the sum is
    all-reduced over the pipeline too; a stage's copy of another stage's parameter (a tied
    table on the last stage, ``stages.mark_stage_copy``) is counted once, by the other.
    ep_group: the ranks a MoE layer's experts are split across (``sharding.is_expert_split``
    tensors: each rank holds others, the same as its expert-data peers): their squares are
    summed over ``ep_group`` alone, each expert counted once, and added to the rest's.
    """
    rank = tp_rank(group)
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    copies = {name for name, p in model.named_parameters() if is_stage_copy(p)}
    device = grads[0][1].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    dp_sharded = False
    experts = torch.zeros((), dtype=torch.float32, device=device)
    split = {name for name, p in model.named_parameters() if is_expert_split(p)}
    if split and ep_group is None:  # before any collective
        raise ValueError(f"clip_grad_norm_: {sorted(split)[0]} holds part of its layer's "
                         "experts; pass the EP group (ep_group=) to count each once")
    for name, g in grads:
        if name in copies:  # another stage's parameter too: counted there, scaled here
            continue
        if name in split:
            experts += g.float().pow(2).sum()
            continue
        if is_dtensor(g):
            dp_sharded = True
            g = _owned_dp_local(ownership, name, g, rank)
            if g is not None:
                sq += g.float().pow(2).sum()
            continue
        for piece in owned_pieces(ownership, name, g, rank):  # every block of a fused dim
            sq += piece.float().pow(2).sum()
    if tp_size(group) > 1:
        dist.all_reduce(sq, group=group)
    if dp_sharded and dp_group is not None and tp_size(dp_group) > 1:
        dist.all_reduce(sq, group=dp_group)
    if split:
        if tp_size(ep_group) > 1:
            dist.all_reduce(experts, group=ep_group)
        sq = sq + experts
    if pp_group is not None and tp_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    if max_norm > 0:
        scale = torch.where(norm.isfinite(), (max_norm / (norm + 1e-6)).clamp(max=1.0),
                            torch.ones_like(norm))
        for _, g in grads:
            local = local_part(g)
            local.mul_(scale.to(local.dtype))
    return norm


def _owned_dp_local(ownership: ShardOwnership, name: str, g, rank: int) -> torch.Tensor | None:
    """The part of this dp rank's piece of an FSDP2 gradient that TP rank ``rank`` owns.

    Ownership is all or nothing for every parameter tensorpar makes (a column or row shard is
    its own; a replicated tensor or a KV head another rank also holds belongs to the lowest such
    rank): then the local piece counts whole or not at all. Anything else (a fused dim that
    another rank partly holds) is gathered over dp and cut as without data parallelism; every
    dp rank of the TP rank takes the same branch, since they share the ownership map."""
    owned = ownership.owned_ranges(name, rank)
    spec = ownership.shards[name][rank]
    if not owned:
        return None
    whole = spec.dim is None or owned == [(a, b) for a, b in spec.ranges()]
    if whole:
        return g.to_local()
    pieces = owned_pieces(ownership, name, g.full_tensor(), rank)
    return torch.cat([piece.reshape(-1) for piece in pieces]) if dist.get_rank(
        g.device_mesh.get_group()) == 0 else None
def rank_sizes(model: nn.Module, ownership: ShardOwnership) -> dict[str, int]:
    """Elements this rank holds (of an FSDP2 DTensor, its own piece), and the dense model's
    element count (of its part, another stage's parameters left out)."""
    local = sum(local_part(p).numel() for p in model.parameters())
    dense = sum(ownership.numel(name) for name, p in model.named_parameters()
                if not is_stage_copy(p))  # a tied table's copy: the first stage's counts
    return {"local": local, "dense": dense}
