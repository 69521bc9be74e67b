"""Context-parallel attention: the sequence split over the CP ranks, keys and values all-gathered.

Each CP rank holds its load-balanced chunks of the sequence (``parallel/context.py``: rank i of N
holds chunks i and 2N-1-i of 2N) and computes everything per token on them alone: the
projections, rotary positions, the MLP. Attention is the one place a token reads the others::

    x_i (B, T_i, D) ──> q_i, k_i, v_i                       this rank's tokens, its TP heads
        k, v = all-gather(k_i, v_i) over CP  (B, kv, T, hd)  one collective for both, rank order
        softmax(q_i k^T / sqrt(hd) + mask_i) v               mask_i: the global positions of the
                                                              rank's queries against all T keys
        backward: dk, dv reduce-scattered back to the ranks that hold each key

The mask is built from global positions, so attention is exact (the same softmax rows as on one
device, no merging of partial softmaxes): key s is visible to query t when s <= t and, for packed
examples, both lie in the same example (an example starts where ``position_ids`` is 0). Rotary
tables cover the whole sequence as without CP; each rank takes its tokens' rows.

Why all-gather and not a ring: one collective per layer and direction, exact on gloo with no
online-softmax merge to get right, and the simplest backward (a reduce-scatter). Its cost is
memory: each rank holds the whole sequence's K and V for its KV heads during attention
(2 x B x T x kv_local x hd values, a fraction kv_heads / heads of the activations when GQA) and
the full (T_i, T) score block when the fused kernel does not run. A ring (pass K/V blocks to the
neighbour, merge the softmax online) holds only two blocks at a time and overlaps the transfer
with the block's compute: it wins when T is long enough that the gathered K/V or the scores no
longer fit, or on fast links where the overlap hides the transfer.

The weights' gradients are partial on each CP rank (its tokens' share): they are summed over the
CP group together with the data-parallel sum, as for any split of the batch's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from tensorpar.parallel.context import (
    check_cp_split,
    cp_key_index,
    cp_sizes,
    cp_token_index,
    gather_kv_from_cp,
)
from tensorpar.runtime.groups import tp_rank, tp_size


@dataclass(frozen=True)
class CPSequence:
    """The whole sequence a CP rank's tokens belong to (what a rank cannot see from its chunks).

    seq_len: T, the full length of every row.
    position_ids: (B, T) the position of every token of the whole rows (each CP rank holds all
        of it: T integers a row); packed examples restart at 0, and nothing attends across an
        example's start. None: one sequence a row, positions 0 .. T-1.
    """

    seq_len: int
    position_ids: torch.Tensor | None = None


def example_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: which packed example each token is in (a new one starts at each 0)."""
    return (position_ids_BT == 0).long().cumsum(-1)


def cp_size(group: ProcessGroup | None) -> int:
    """The CP size: 1 when there is no CP group (None here is no CP, not the world)."""
    return 1 if group is None else tp_size(group)


def check_cp_input(x: torch.Tensor, context: CPSequence | None, rope, group: ProcessGroup | None,
                   what: str = "context-parallel attention", tokens: int | None = None) -> None:
    """Refuse, before any collective, what this rank can tell is wrong: the split itself, its
    token count (``tokens``, default ``x``'s; under sequence parallelism the CP rank's count,
    of which ``x`` is this TP rank's shard), the position ids' and rotary tables' lengths."""
    n = cp_size(group)
    if context is None:
        raise ValueError(f"{what}: a CP group of {n} ranks needs context=CPSequence(seq_len, "
                         "position_ids) (the full length and positions)")
    T = context.seq_len
    check_cp_split(T, n, what)
    mine = cp_sizes(T, n)[tp_rank(group)]
    held = x.shape[1] if tokens is None else tokens
    if held != mine:
        raise ValueError(f"{what}: CP rank {tp_rank(group)} holds {held} tokens, but "
                         f"seq_len={T} over {n} CP ranks gives it {mine} (split_to_cp)")
    pos = context.position_ids
    if pos is not None and tuple(pos.shape) != (x.shape[0], T):
        raise ValueError(f"{what}: position_ids are {tuple(pos.shape)}, expected the whole "
                         f"rows ({x.shape[0]}, {T})")
    if rope is not None and rope[0].shape[-2] != T:
        raise ValueError(f"{what}: the rotary tables cover {rope[0].shape[-2]} positions; under "
                         f"CP they cover the whole sequence, {T}")


def cp_rope(rope: tuple[torch.Tensor, torch.Tensor], seq_len: int,
            group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the rotary tables ((T, hd/2), or (B, 1, T, hd/2) per token)."""
    idx = cp_token_index(seq_len, cp_size(group), tp_rank(group), rope[0].device)
    return rope[0].index_select(-2, idx), rope[1].index_select(-2, idx)


def cp_attention_mask(context: CPSequence, group: ProcessGroup | None, causal: bool,
                      device=None) -> torch.Tensor:
    """(B or 1, 1, T_i, T) bool, True where this rank's query may read a gathered key (keys in
    rank order). Every row holds at least its own token, so no softmax row is empty."""
    n, T = cp_size(group), context.seq_len
    q_pos = cp_token_index(T, n, tp_rank(group), device)  # (T_i,)
    k_pos = cp_key_index(T, n, device)  # (T,)
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, T_i, T)
    else:
        mask = torch.ones(1, len(q_pos), T, dtype=torch.bool, device=device)
    if context.position_ids is not None:
        example = example_ids(context.position_ids.to(device))  # (B, T)
        mask = mask & (example[:, q_pos, None] == example[:, None, k_pos])  # (B, T_i, T)
    return mask[:, None]


def cp_keys_values(k: torch.Tensor, v: torch.Tensor, seq_len: int, group: ProcessGroup | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every CP rank's keys and values (B, kv_local, T, hd), from this rank's (B, kv_local, T_i,
    hd), moved as one all-gather (their gradients as one reduce-scatter)."""
    kv = gather_kv_from_cp(torch.stack([k, v]), seq_len, group, dim=3)  # (2, B, kv, T, hd)
    return kv[0], kv[1]


def attention_collective_counts(tp: int, cp: int, kv_shared: bool = False
                                ) -> dict[str, dict[str, int]]:
    """The collectives of one forward and one backward of ``ParallelSelfAttention`` (no SP) at
    TP size ``tp`` and CP size ``cp``, for an input that requires grad.

    TP: the output projection's all-reduce (forward), the input gradient's (backward), one more
    when KV heads are shared. CP: the K/V all-gather (forward), their gradients' reduce-scatter
    (backward)."""
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    if tp > 1:
        fwd["all_reduce"] = 1
        bwd["all_reduce"] = 2 if kv_shared else 1
    if cp > 1:
        fwd["all_gather"] = 1
        bwd["reduce_scatter"] = 1
    return {"forward": fwd, "backward": bwd}
