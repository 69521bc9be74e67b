"""Summing, in backward, the gradients of parameters that several ranks hold.

Some parameters are replicated across the TP group but see different data on each rank: norm
weights and the row-parallel bias under sequence parallelism (each rank holds other tokens), KV
heads shared between ranks (each rank serves other query heads). Each rank's gradient is then a
partial sum. ``sum_grads_in_backward`` wraps such parameters where they are used: identity in
forward, and in backward one all-reduce that sums all their gradients, so every copy gets the
dense gradient and no separate "sync the gradients" step exists to be forgotten.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.runtime.groups import tp_size


class _SumGradsInBackward(torch.autograd.Function):
    """forward: identity on each tensor, backward: one all-reduce summing all their gradients.

    Each gradient is written at ``offsets[i]`` of a flat zero buffer of ``total`` elements that is
    all-reduced once. Tensors replicated on every rank sit at the same offset everywhere; a shard
    replicated on only some ranks (a KV head shared by two ranks) sits at its place in the dense
    tensor, so each rank gets the sum over exactly the ranks that hold it.
    """

    @staticmethod
    def forward(ctx, group, offsets, total, *tensors):
        ctx.group, ctx.offsets, ctx.total = group, offsets, total
        ctx.shapes = [t.shape for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        flat = ref.new_zeros(ctx.total)
        for g, off, shape in zip(grads, ctx.offsets, ctx.shapes, strict=True):
            if g is not None:
                flat[off : off + shape.numel()] = g.reshape(-1)
        dist.all_reduce(flat, group=ctx.group)
        # clones: views would keep the whole (possibly dense-size) buffer alive as .grad
        out = [flat[off : off + s.numel()].view(s).clone()
               for off, s in zip(ctx.offsets, ctx.shapes, strict=True)]
        return (None, None, None, *out)


def sum_grads_in_backward(
    tensors: list[torch.Tensor],
    group: ProcessGroup | None = None,
    offsets: list[int] | None = None,
    total: int | None = None,
) -> list[torch.Tensor]:
    """Identity in forward; in backward, the gradients of ``tensors`` are summed over the group.

    Used on parameters that several ranks hold but that see different data: norm weights and the
    row-parallel bias under sequence parallelism, KV heads shared between ranks. One all-reduce
    covers all of ``tensors``. By default they are packed back to back; ``offsets``/``total`` place
    them in a larger buffer instead (see ``_SumGradsInBackward``).
    """
    if tp_size(group) == 1 or not tensors:
        return list(tensors)
    if offsets is None:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
    return list(_SumGradsInBackward.apply(group, offsets, total, *tensors))


def sum_shared_shard_grads(params: list[torch.Tensor | None],
                           group: ProcessGroup | None = None,
                           spec=None) -> list[torch.Tensor | None]:
    """``sum_grads_in_backward`` for dim-0 shards that some ranks hold in common (KV heads shared
    by several ranks): each shard is placed where it sits in its dense tensor, so each rank's
    gradient is summed over exactly the ranks that hold the same rows. None entries pass through.
    spec: the ``ShardSpec`` every one of them has (default: each one's ``tp_shard``; pass it
    where the tensors may be untagged, as FSDP2's gathered parameters are).
    """
    present = [p for p in params if p is not None]
    offsets, total = [], 0
    for p in present:
        spec_p = spec or p.tp_shard
        row = p.numel() // (spec_p.stop - spec_p.start)
        offsets.append(total + spec_p.start * row)
        total += spec_p.full_size * row
    summed = iter(sum_grads_in_backward(present, group, offsets, total))
    return [None if p is None else next(summed) for p in params]
