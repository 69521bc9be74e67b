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

(``sum_grads_in_backward``, for parameters several ranks hold, lives in ``grad_sync.py``.)

Last-dim shards may be uneven (``torch.tensor_split`` sizes): the gather pads every shard to the
largest, gathers, and trims. Sequence shards must be even: a rank holding T/n rows cannot know T
without another collective, so a sequence length that does not divide by the TP size is refused
(with a ``ValueError`` raised on every rank, before any communication).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.groups import tp_rank, tp_size

SEQ_DIM = 1  # activations are (B, T, D)

# torch 2.13 renamed the single-tensor collectives; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- plain collectives (no autograd), out of place -------------------------------------------------


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(
    x: torch.Tensor, dim: int, sizes: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; rank r holds ``sizes[r]`` rows of it."""
    dim = dim % x.dim()
    longest = max(sizes)
    if x.shape[dim] < longest:  # uneven shards: pad to the largest so one all-gather carries all
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim)
    x = x.contiguous()
    # gloo takes only the concatenated layout (n * rows, ...); view it as (n, *x.shape)
    gathered = x.new_empty((len(sizes) * x.shape[0], *x.shape[1:]))
    _all_gather_single(gathered, x, group=group)
    even = all(s == longest for s in sizes)
    if even and dim == 0:
        return gathered  # the concatenated layout is already the answer
    stacked = gathered.view(len(sizes), *x.shape)
    if even:
        return torch.cat(stacked.unbind(0), dim)
    return torch.cat([stacked[r].narrow(dim, 0, s) for r, s in enumerate(sizes)], dim)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    return torch.tensor_split(x, tp_size(group), dim)[tp_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the ranks, then keep this rank's even shard of ``dim``."""
    n = tp_size(group)
    stacked = torch.stack(x.chunk(n, dim))  # (n, ..., T/n, ...): one contiguous input
    out = x.new_empty(stacked.shape[1:])
    _reduce_scatter_single(out, stacked.flatten(0, 1), group=group)
    return out


def _gather_sequence(x: torch.Tensor, group: ProcessGroup | None, async_op: bool = False):
    """All-gather of even sequence shards: (B, T/n, D) -> (B, T, D), into a fresh buffer.

    async_op: only start it and return ``wait``, which waits and returns the (B, T, D)."""
    n, x = tp_size(group), x.contiguous()
    gathered = x.new_empty((n * x.shape[0], *x.shape[1:]))  # gloo's layout: (n·B, T/n, D)
    work = _all_gather_single(gathered, x, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        if x.shape[0] == 1:  # (n, T/n, D) is already (1, T, D) in memory
            return gathered.view(1, -1, *x.shape[2:])
        return torch.cat(gathered.view(n, *x.shape).unbind(0), SEQ_DIM)

    return wait if async_op else wait()


def _check_sequence(x: torch.Tensor, n: int, what: str) -> None:
    if x.dim() < 3:
        raise ValueError(f"{what}: expected activations (B, T, D), got shape {tuple(x.shape)}")
    if x.shape[SEQ_DIM] % n != 0:
        raise ValueError(
            f"{what}: sequence length {x.shape[SEQ_DIM]} does not divide by the TP size {n}; "
            "sequence parallelism needs T % tp_size == 0"
        )


# -- the conjugate pairs ---------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """forward: identity, backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce, backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim, backward: split along the last dim."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.sizes, ctx.rank = sizes, tp_rank(group)
        return _all_gather(x, -1, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(-1, start, ctx.sizes[ctx.rank]).contiguous(), None, None


class _ScatterToTP(torch.autograd.Function):
    """forward: split along the last dim, backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.sizes = group, shard_sizes(x.shape[-1], tp_size(group))
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.sizes, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along the sequence dim, backward: reduce-scatter along it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter along the sequence dim, backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """forward: split along the sequence dim, backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


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
        mine = torch.tensor([x.shape[-1]], device=x.device)
        sizes = _all_gather(mine, 0, [1] * n, group).tolist()
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


def gather_from_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, T/n, D) -> (B, T, D): all-gather forward, reduce-scatter backward.

    Every rank must hold the same T/n tokens, as the SP embedding, ``scatter_to_sequence`` and
    ``reduce_scatter_to_sequence`` produce; checking that would cost a collective per layer.
    """
    n = tp_size(group)
    if n == 1:
        return x
    if x.dim() < 3:
        raise ValueError(f"gather_from_sequence: expected (B, T/n, D), got shape {tuple(x.shape)}")
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, T, D) partial sums -> (B, T/n, D) sum: reduce-scatter forward, all-gather back."""
    n = tp_size(group)
    if n == 1:
        return x
    _check_sequence(x, n, "reduce_scatter_to_sequence")
    return _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, T, D) replicated -> (B, T/n, D) shard: split forward, all-gather backward."""
    n = tp_size(group)
    if n == 1:
        return x
    _check_sequence(x, n, "scatter_to_sequence")
    return _ScatterToSequence.apply(x, group)


def enter_tp_region(
    x: torch.Tensor, sequence_parallel: bool, group: ProcessGroup | None
) -> torch.Tensor:
    """The input side of a column-parallel block: f, or the sequence all-gather under SP."""
    return gather_from_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


def exit_tp_region(
    x: torch.Tensor, sequence_parallel: bool, group: ProcessGroup | None
) -> torch.Tensor:
    """The output side of a row-parallel block: g, or the sequence reduce-scatter under SP."""
    return reduce_scatter_to_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)
