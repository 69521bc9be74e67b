"""Moving tokens to the experts that chose them and back: the autograd pairs of expert
parallelism.

Tokens are rows of a flat (N, D) tensor. The pairs::

    dispatch_to_experts   forward: all-to-all        backward: all-to-all (reverse)
    combine_from_experts  forward: all-to-all        backward: all-to-all (reverse)
    split_tokens          forward: split (rows)      backward: all-gather (rows)
    gather_tokens         forward: all-gather (rows) backward: split (rows)
    permute_rows          forward: rows reordered    backward: the gradient's rows put back

A rank sends ``send_sizes[s]`` rows to rank s and receives ``recv_sizes[s]`` from it; the sizes
differ from rank to rank (the router decides them), so every rank learns what it will receive
first, from one all-to-all of the per-expert counts (``exchange_expert_counts``). The reverse
all-to-all of backward swaps the two lists: each gradient row goes back where its token came
from. ``split_tokens`` and ``gather_tokens`` divide the tokens that every rank of a TP group
holds alike into ``tensor_split`` row shards, so that each TP rank routes and sends only its
own share, and put the shares back together after the experts. With one rank all of them
return their input.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tensorpar.parallel.collectives import all_gather, all_to_all, split
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.groups import tp_rank, tp_size


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all, backward: all-to-all (reverse)."""

    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        return all_to_all(x, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes = ctx.sizes
        return all_to_all(grad, recv_sizes, send_sizes, ctx.group), None, None, None


class _PermuteRows(torch.autograd.Function):
    """forward: y[i] = x[perm[i]], backward: g_x[perm[i]] = g_y[i] (no collective)."""

    @staticmethod
    def forward(ctx, x, perm):
        ctx.save_for_backward(perm)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (perm,) = ctx.saved_tensors
        # a permutation writes every row once: no zero fill, no accumulation
        return torch.empty_like(grad).index_copy_(0, perm, grad), None


class _SplitTokens(torch.autograd.Function):
    """forward: split (rows), backward: all-gather (rows)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.sizes = group, shard_sizes(x.shape[0], tp_size(group))
        return split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, 0, ctx.sizes, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """forward: all-gather (rows), backward: split (rows)."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group = group
        return all_gather(x, 0, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, 0, ctx.group), None, None


def dispatch_to_experts(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                        group: ProcessGroup | None = None) -> torch.Tensor:
    """(sum(send_sizes), D) rows, grouped by destination rank -> (sum(recv_sizes), D) rows,
    grouped by source rank: all-to-all forward, the reverse all-to-all backward."""
    if tp_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(send_sizes), list(recv_sizes), group)


def combine_from_experts(y: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                         group: ProcessGroup | None = None) -> torch.Tensor:
    """The way back of ``dispatch_to_experts``, given the sizes it was called with: each row
    returns to the rank it came from (all-to-all forward, the reverse all-to-all backward)."""
    if tp_size(group) == 1:
        return y
    return _AllToAll.apply(y, list(recv_sizes), list(send_sizes), group)


def exchange_expert_counts(counts: torch.Tensor, experts_per_rank: list[int],
                           group: ProcessGroup | None = None) -> torch.Tensor:
    """(E,) rows this rank sends to each expert -> (n, E_local): row s holds what rank s sends
    to each of this rank's experts. One all-to-all of the counts (no gradient); rank r holds
    ``experts_per_rank[r]`` consecutive experts."""
    n = tp_size(group)
    mine = experts_per_rank[tp_rank(group)]
    if n == 1:
        return counts.view(1, -1)
    received = all_to_all(counts, experts_per_rank, [mine] * n, group)
    return received.view(n, mine)


def permute_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """(M, ...) rows reordered by ``perm``, a permutation of range(M): row i of the result is
    row ``perm[i]`` of x. Its gradient is the reverse reordering (one copy, where indexing's
    would fill zeros and accumulate)."""
    return _PermuteRows.apply(x, perm)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``perm``: ``permute_rows(permute_rows(x, perm), inv)`` is x."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(),
                                                                  device=perm.device))


def split_tokens(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """(N, ...) rows that every rank holds alike -> this rank's ``tensor_split`` share of them:
    split forward, all-gather backward (each rank's gradient covers its share only)."""
    return x if tp_size(group) == 1 else _SplitTokens.apply(x, group)


def gather_tokens(x: torch.Tensor, total: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Each rank's ``tensor_split`` share of ``total`` rows -> all of them: all-gather forward,
    split backward (the gradient of the gathered rows is the same on every rank)."""
    n = tp_size(group)
    if n == 1:
        return x
    sizes = shard_sizes(total, n)
    if x.shape[0] != sizes[tp_rank(group)]:
        raise ValueError(f"gather_tokens: rank {tp_rank(group)} holds {x.shape[0]} rows, but a "
                         f"split of {total} over {n} ranks gives it {sizes[tp_rank(group)]}")
    return _GatherTokens.apply(x, group, sizes)
