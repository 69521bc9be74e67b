"""Context parallelism's split of the sequence and its two autograd pairs.

A sequence of T tokens is cut into 2N chunks as ``torch.tensor_split(range(T), 2N)`` cuts, and
CP rank i holds chunks i and 2N-1-i (causal load balancing: under a causal mask the early chunks
read few keys and the late ones many; pairing the i-th from the front with the i-th from the
back gives every rank the same share of the triangle)::

    T = 30, N = 2: chunks 0..3 of 8, 8, 7, 7 tokens
    rank 0: chunk 0 [0, 8)  + chunk 3 [23, 30)   15 tokens
    rank 1: chunk 1 [8, 16) + chunk 2 [16, 23)   15 tokens

    gather_kv_from_cp   forward: all-gather (rank order)   backward: reduce-scatter
    gather_from_cp      forward: all-gather, tokens put back in order   backward: split
    split_to_cp         this rank's two chunks (a plain function: batches, no gradient)

The gathered keys stay in rank order (rank 0's chunks, then rank 1's, ...): attention reads keys
in any order as long as the mask knows each key's position (``cp_key_index``), so no reorder is
paid on the way in or back.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tensorpar.parallel.collectives import all_gather, pad_to, start_reduce_scatter
from tensorpar.parallel.sharding import shard_range
from tensorpar.runtime.groups import tp_rank, tp_size


def check_cp_split(seq_len: int, n: int, what: str = "context parallelism") -> None:
    """Every one of the 2N chunks must hold at least one token."""
    if n < 1:
        raise ValueError(f"{what}: the CP size must be >= 1, got {n}")
    if n > 1 and seq_len < 2 * n:
        raise ValueError(f"{what}: a sequence of {seq_len} tokens cannot be cut into {2 * n} "
                         f"chunks for {n} CP ranks (each rank holds 2 chunks; need "
                         f"seq_len >= {2 * n}, or cp <= {seq_len // 2})")


def cp_chunk_ranges(seq_len: int, n: int, rank: int) -> list[tuple[int, int]]:
    """The token ranges [start, stop) rank ``rank`` of ``n`` holds: chunks rank and 2n-1-rank
    of ``tensor_split`` into 2n (one range, the whole sequence, when n is 1)."""
    if n == 1:
        return [(0, seq_len)]
    return [shard_range(seq_len, 2 * n, rank), shard_range(seq_len, 2 * n, 2 * n - 1 - rank)]


def cp_sizes(seq_len: int, n: int) -> list[int]:
    """How many tokens each of the n CP ranks holds, in rank order."""
    return [sum(b - a for a, b in cp_chunk_ranges(seq_len, n, r)) for r in range(n)]


def cp_token_index(seq_len: int, n: int, rank: int, device=None) -> torch.Tensor:
    """(T_rank,) int64: the global positions of this rank's tokens, in the order it holds them."""
    return torch.cat([torch.arange(a, b, device=device)
                      for a, b in cp_chunk_ranges(seq_len, n, rank)])


def cp_key_index(seq_len: int, n: int, device=None) -> torch.Tensor:
    """(T,) int64: the global position of each row of the gathered keys (rank order)."""
    return torch.cat([cp_token_index(seq_len, n, r, device) for r in range(n)])


def split_to_cp(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced chunks of ``x`` along ``dim`` (the sequence), concatenated."""
    T, n = x.shape[dim], tp_size(group)
    check_cp_split(T, n, "split_to_cp")
    if n == 1:
        return x
    return x.index_select(dim, cp_token_index(T, n, tp_rank(group), x.device))


def reduce_scatter_sizes(x: torch.Tensor, dim: int, sizes: list[int],
                         group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the ranks, then keep rows [sum(sizes[:r]), +sizes[r]) of ``dim`` (rank r's
    slice, ``sizes`` in rank order), in a fresh tensor. Slices are padded to the largest so one
    reduce-scatter moves them all."""
    dim = dim % x.dim()
    longest = max(sizes)
    slices = torch.split(x, sizes, dim)
    stacked = torch.stack([pad_to(s, dim, longest) for s in slices])  # (n, ..., longest, ...)
    out = start_reduce_scatter(x.new_empty(stacked.shape[1:]), stacked.flatten(0, 1), group)()
    mine = sizes[tp_rank(group)]
    return out if mine == longest else out.narrow(dim, 0, mine).contiguous()


class _GatherKVFromCP(torch.autograd.Function):
    """forward: all-gather along ``dim`` in rank order, backward: reduce-scatter along it."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sizes(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _GatherFromCP(torch.autograd.Function):
    """forward: all-gather along ``dim``, tokens put back in sequence order, backward: split
    (this rank's chunks of the gradient)."""

    @staticmethod
    def forward(ctx, x, dim, seq_len, group):
        n, rank = tp_size(group), tp_rank(group)
        ctx.dim, ctx.mine = dim, cp_token_index(seq_len, n, rank, x.device)
        gathered = all_gather(x, dim, cp_sizes(seq_len, n), group)  # rank order
        order = torch.argsort(cp_key_index(seq_len, n, x.device))  # rank order -> positions
        return gathered.index_select(dim, order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.mine), None, None, None


def gather_kv_from_cp(x: torch.Tensor, seq_len: int, group: ProcessGroup | None,
                      dim: int = 2) -> torch.Tensor:
    """Every CP rank's keys (or values) ``x`` along ``dim``, in rank order (``cp_key_index``
    gives each row's position); the gradient is summed back to the rank that holds each row."""
    n = tp_size(group)
    return x if n == 1 else _GatherKVFromCP.apply(x, dim, cp_sizes(seq_len, n), group)


def gather_from_cp(x: torch.Tensor, seq_len: int, group: ProcessGroup | None,
                   dim: int = 1) -> torch.Tensor:
    """The whole sequence, in order, from every rank's ``split_to_cp`` chunks (the inverse of
    ``split_to_cp``); the gradient of each rank's chunks is its slice of the output's."""
    n = tp_size(group)
    if n == 1:
        return x
    check_cp_split(seq_len, n, "gather_from_cp")
    mine = cp_sizes(seq_len, n)[tp_rank(group)]
    if x.shape[dim] != mine:
        raise ValueError(f"gather_from_cp: rank {tp_rank(group)} holds {x.shape[dim]} tokens, "
                         f"but {seq_len} tokens over {n} CP ranks give it {mine}")
    return _GatherFromCP.apply(x, dim, seq_len, group)
