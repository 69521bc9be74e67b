"""The plain collectives under the autograd pairs of ``mappings.py``: out of place, no autograd.

Every shard follows ``torch.tensor_split``: sizes differ by at most one, larger first. A gather
of uneven shards pads each to the largest, moves them in one all-gather, and trims; a
reduce-scatter pads each rank's slice of its input the same way. So an uneven split costs the
bytes of the even split of the padded size (T = 63 over 2 ranks moves 2 x 32 rows), never a
second collective.

Under ``torch.compile`` the same functions issue torch's functional collectives
(``torch.distributed._functional_collectives``), which dynamo traces into the graph: no graph
break, and the compiler may move their waits to overlap them with compute. ``start_*`` return a
``wait`` in both modes: the c10d work handle's wait in eager, the functional result when compiled.

Sequence shards carry no record of the full length T: rank r holding ``T_r`` rows cannot tell
the other ranks' sizes. The callers either know T (``shard_sizes(T, n)``; the GPT does) or ask
the ranks for their sizes with ``exchange_sizes``, one all-gather of an int64 per rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.asserts import is_compiling
from tensorpar.runtime.groups import tp_rank, tp_size

SEQ_DIM = 1  # activations are (B, T, D)

# torch 2.13 renamed the single-tensor collectives; older releases have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pg(group: ProcessGroup | None) -> ProcessGroup:
    """The group itself, the world for None (the functional collectives take no None)."""
    return dist.group.WORLD if group is None else group


def group_name(group: ProcessGroup | None) -> str:
    """The name torch registered the group under (the world's for None): what a custom op takes
    in place of the group (``torch.distributed.distributed_c10d._resolve_process_group``)."""
    return _pg(group).group_name


def all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in a fresh tensor."""
    if is_compiling():
        return funcol.all_reduce(x.contiguous(), "sum", _pg(group))
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def start_all_reduce(x: torch.Tensor, group: ProcessGroup | None):
    """Start summing ``x`` over the ranks, in place (``x``: a fresh tensor that nothing else
    references); returns ``wait``, which returns the sum."""
    if is_compiling():
        out = funcol.all_reduce(x, "sum", _pg(group))
        return lambda: out
    work = dist.all_reduce(x, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return x

    return wait


def start_reduce_scatter(out: torch.Tensor, rows: torch.Tensor, group: ProcessGroup | None):
    """Start the reduce-scatter of ``rows`` (n * k, ...) into ``out`` (k, ...): rank r receives
    the sum of rows [r k, (r + 1) k). Returns ``wait``, which returns the result (``out`` in
    eager; a new tensor when compiled)."""
    if is_compiling():
        result = funcol.reduce_scatter_tensor(rows, "sum", 0, _pg(group))
        return lambda: result
    work = reduce_scatter_single(out, rows, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out

    return wait


def pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` (``x`` itself if that long)."""
    if x.shape[dim] >= size:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad_shape)], dim)


def all_gather(x: torch.Tensor, dim: int, sizes: list[int], group: ProcessGroup | None,
               async_op: bool = False):
    """Concatenate every rank's ``x`` along ``dim``; rank r holds ``sizes[r]`` of it.

    async_op: only start the all-gather and return ``wait``, which waits and returns the result
    (so work can run while the shards travel)."""
    n, dim = len(sizes), dim % x.dim()
    longest = max(sizes)
    x = pad_to(x, dim, longest).contiguous()
    # gloo takes only the concatenated layout (n * rows, ...); viewed as (n, *x.shape)
    if is_compiling():
        gathered, work = funcol.all_gather_tensor(x, 0, _pg(group)), None
    else:
        gathered = x.new_empty((n * x.shape[0], *x.shape[1:]))
        work = all_gather_single(gathered, x, group=group, async_op=async_op)

    def wait() -> torch.Tensor:
        if work is not None:
            work.wait()
        even = all(s == longest for s in sizes)
        if even and math.prod(x.shape[:dim]) == 1:  # the layout is already the answer
            shape = list(x.shape)
            shape[dim] *= n
            return gathered.view(shape)
        stacked = gathered.view(n, *x.shape)
        if even:
            return torch.cat(stacked.unbind(0), dim)
        return torch.cat([stacked[r].narrow(dim, 0, s) for r, s in enumerate(sizes)], dim)

    return wait if async_op else wait()


def split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's ``tensor_split`` shard of ``dim``."""
    return torch.tensor_split(x, tp_size(group), dim)[tp_rank(group)].contiguous()


def stacked_shards(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """(n, ...) : the ``tensor_split`` shards of ``dim``, each padded to the largest, stacked:
    the input a reduce-scatter takes (rank r receives the sum of row r)."""
    longest = shard_sizes(x.shape[dim], n)[0]
    return torch.stack([pad_to(p, dim, longest) for p in torch.tensor_split(x, n, dim)])


def trim_shard(out: torch.Tensor, dim: int, full: int, group: ProcessGroup | None) -> torch.Tensor:
    """The reduce-scatter output ``out`` (padded to the largest shard) cut to this rank's size of
    a dim of ``full``."""
    mine = shard_sizes(full, tp_size(group))[tp_rank(group)]
    return out if out.shape[dim] == mine else out.narrow(dim, 0, mine).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the ranks, then keep this rank's ``tensor_split`` shard of ``dim``."""
    stacked = stacked_shards(x, dim, tp_size(group))
    out = start_reduce_scatter(x.new_empty(stacked.shape[1:]), stacked.flatten(0, 1), group)()
    return trim_shard(out, dim, x.shape[dim], group)


def all_to_all(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
               group: ProcessGroup | None) -> torch.Tensor:
    """Rank r sends rows ``[sum(send_sizes[:s]), +send_sizes[s])`` of ``x`` to rank s and
    receives ``recv_sizes[s]`` rows from each rank s, concatenated in rank order, in a fresh
    tensor (uneven sizes allowed: each rank's ``recv_sizes`` are the others' ``send_sizes`` to
    it)."""
    x = x.contiguous()
    if is_compiling():
        return funcol.all_to_all_single(x, recv_sizes, send_sizes, _pg(group))
    out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv_sizes, send_sizes, group=group)
    return out


def exchange_sizes(size: int, group: ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's ``size``, in rank order (one all-gather of an int64 per rank)."""
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    return all_gather(mine, 0, [1] * tp_size(group), group).tolist()


def sequence_sizes(x: torch.Tensor, group: ProcessGroup | None, seq_len: int | None,
                   what: str) -> list[int]:
    """The sequence shard sizes of the n ranks, for an all-gather of ``x`` (B, T_r, D).

    seq_len: the full length T, when the caller knows it: no communication, and this rank's
        shard is checked against its ``tensor_split`` size. None: the ranks exchange their sizes
        first (``exchange_sizes``) and all refuse sizes that are not a ``tensor_split``."""
    n, rank = tp_size(group), tp_rank(group)
    if x.dim() < 3:
        raise ValueError(f"{what}: expected a sequence shard (B, T/n, D), got shape "
                         f"{tuple(x.shape)}")
    if seq_len is None:
        held = exchange_sizes(x.shape[SEQ_DIM], group, x.device)
        seq_len = sum(held)
        if held != shard_sizes(seq_len, n):
            raise ValueError(f"{what}: the ranks hold {held} tokens of the sequence; a split of "
                             f"{seq_len} tokens over {n} ranks is {shard_sizes(seq_len, n)} "
                             "(torch.tensor_split)")
    sizes = shard_sizes(seq_len, n)
    if x.shape[SEQ_DIM] != sizes[rank]:
        raise ValueError(f"{what}: rank {rank} holds {x.shape[SEQ_DIM]} tokens, but a split of "
                         f"seq_len={seq_len} over {n} ranks gives it {sizes[rank]}")
    check_sequence_length(seq_len, n, what)
    return sizes


def check_sequence_length(seq_len: int, n: int, what: str) -> None:
    """Every rank must hold at least one token of the sequence."""
    if seq_len < n:
        raise ValueError(f"{what}: sequence length {seq_len} is shorter than the TP size {n}; "
                         "sequence parallelism needs at least one token per rank")
