"""Autograd-aware collectives, in conjugate pairs (Shoeybi et al., 2019, section 3).

Each pair is one ``torch.autograd.Function``; its first docstring line says what it does in forward
and in backward. The public snake_case wrappers are what layers call; with one rank every wrapper
returns its input unchanged. Collectives run on fresh tensors, never on one autograd has saved.

    copy_to_tp            forward: identity        backward: all-reduce     (the paper's f)
    reduce_from_tp        forward: all-reduce      backward: identity       (the paper's g)
    gather_from_tp        forward: all-gather      backward: split          (last dim)
    scatter_to_tp         forward: split           backward: all-gather     (last dim)
    gather_from_sequence  forward: all-gather      backward: reduce-scatter (dim 1, sequence)
    reduce_scatter_to_sequence  forward: reduce-scatter  backward: all-gather (dim 1)
    scatter_to_sequence   forward: split           backward: all-gather     (dim 1)

    sum_grads_in_backward forward: identity        backward: one all-reduce of several gradients

The last is for parameters several ranks hold but use on different data: norm weights and the
row-parallel bias under sequence parallelism (each rank holds other tokens), KV heads shared
between ranks (each serves other query heads). Each rank's gradient is then a partial sum; the
wrapper, applied where such parameters are used, sums them in backward, so every copy gets the
dense gradient and no separate "sync the gradients" step exists to be forgotten.

Shards may be uneven, last-dim and sequence alike (``torch.tensor_split`` sizes: T = 8 over 3
ranks is 3, 3, 2 tokens); ``collectives.py`` pads and trims. A rank holding a sequence shard
cannot know the others' sizes: ``gather_from_sequence`` (and the column layers over it) take the
full length ``seq_len=T`` where the caller knows it (the GPT passes it) and otherwise exchange
the sizes first, one small all-gather more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.parallel.collectives import (
    SEQ_DIM,
    all_gather,
    all_reduce,
    check_sequence_length,
    exchange_sizes,
    reduce_scatter,
    sequence_sizes,
    split,
)
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.groups import tp_rank, tp_size

# -- the conjugate pairs ---------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """forward: identity, backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce, backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim, backward: split along the last dim."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.sizes, ctx.rank = sizes, tp_rank(group)
        return all_gather(x, -1, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(-1, start, ctx.sizes[ctx.rank]).contiguous(), None, None


class _ScatterToTP(torch.autograd.Function):
    """forward: split along the last dim, backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.sizes = group, shard_sizes(x.shape[-1], tp_size(group))
        return split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, -1, ctx.sizes, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along the sequence dim, backward: reduce-scatter along it."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group = group
        return all_gather(x, SEQ_DIM, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, SEQ_DIM, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter along the sequence dim, backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.sizes = group, shard_sizes(x.shape[SEQ_DIM], tp_size(group))
        return reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ_DIM, ctx.sizes, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """forward: split along the sequence dim, backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.sizes = group, shard_sizes(x.shape[SEQ_DIM], tp_size(group))
        return split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ_DIM, ctx.sizes, ctx.group), None


# -- public wrappers -------------------------------------------------------------------------------


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Enter the TP region with a replicated input: identity forward, all-reduce backward (f)."""
    return x if tp_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Leave the TP region by summing partial results: all-reduce forward, identity backward (g)."""
    return x if tp_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(
    x: torch.Tensor, group: ProcessGroup | None = None, full_size: int | None = None
) -> torch.Tensor:
    """Concatenate the last-dim shards of all ranks (all-gather forward, split backward).

    full_size: the gathered size of the last dim, when the shards are ``tensor_split``'s of it
        (what the layers pass). Without it the ranks first exchange their shard sizes (one small
        extra all-gather), so shards of any sizes work; assuming even shards instead would let
        gloo abort the process on uneven ones.
    """
    n = tp_size(group)
    if n == 1:
        return x
    if full_size is None:
        sizes = exchange_sizes(x.shape[-1], group, x.device)
    else:
        sizes = shard_sizes(full_size, n)
        if x.shape[-1] != sizes[tp_rank(group)]:
            raise ValueError(
                f"gather_from_tp: rank {tp_rank(group)} holds {x.shape[-1]} of the last dim, "
                f"but a split of {full_size} over {n} ranks gives it {sizes[tp_rank(group)]}"
            )
    return _GatherFromTP.apply(x, group, sizes)


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's ``tensor_split`` shard of the last dim: split forward, all-gather backward."""
    n = tp_size(group)
    if n == 1:
        return x
    if x.shape[-1] < n:
        raise ValueError(f"scatter_to_tp: last dim {x.shape[-1]} is smaller than TP size {n}")
    return _ScatterToTP.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: ProcessGroup | None = None,
                         seq_len: int | None = None) -> torch.Tensor:
    """(B, T_r, D) -> (B, T, D): all-gather forward, reduce-scatter backward.

    Rank r holds its ``tensor_split`` shard of the T tokens, as the SP embedding,
    ``scatter_to_sequence`` and ``reduce_scatter_to_sequence`` produce.
    seq_len: T. Without it the ranks exchange their shard sizes first (one all-gather of an
        int64 per rank); with it nothing more is sent, and a rank whose shard is not its
        ``tensor_split`` size of T raises.
    """
    if tp_size(group) == 1:
        return x
    sizes = sequence_sizes(x, group, seq_len, "gather_from_sequence")
    return _GatherFromSequence.apply(x, group, sizes)


def _check_full_sequence(x: torch.Tensor, n: int, what: str) -> None:
    if x.dim() < 3:
        raise ValueError(f"{what}: expected activations (B, T, D), got shape {tuple(x.shape)}")
    check_sequence_length(x.shape[SEQ_DIM], n, what)


def reduce_scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, T, D) partial sums -> (B, T_r, D) sum: reduce-scatter forward, all-gather back."""
    n = tp_size(group)
    if n == 1:
        return x
    _check_full_sequence(x, n, "reduce_scatter_to_sequence")
    return _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, T, D) replicated -> (B, T_r, D) shard: split forward, all-gather backward."""
    n = tp_size(group)
    if n == 1:
        return x
    _check_full_sequence(x, n, "scatter_to_sequence")
    return _ScatterToSequence.apply(x, group)


def enter_tp_region(x: torch.Tensor, sequence_parallel: bool, group: ProcessGroup | None,
                    seq_len: int | None = None) -> torch.Tensor:
    """The input side of a column-parallel block: f, or the sequence all-gather under SP
    (``seq_len``: the full length, see ``gather_from_sequence``)."""
    if sequence_parallel:
        return gather_from_sequence(x, group, seq_len)
    return copy_to_tp(x, group)


def exit_tp_region(
    x: torch.Tensor, sequence_parallel: bool, group: ProcessGroup | None
) -> torch.Tensor:
    """The output side of a row-parallel block: g, or the sequence reduce-scatter under SP."""
    return reduce_scatter_to_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)


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
