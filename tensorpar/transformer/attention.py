"""Self-attention split by heads: QKV column-parallel, output projection row-parallel.

::

    x ──f──> q, k, v = x W_q,i^T, x W_k,i^T, x W_v,i^T      this rank's heads only
         ──> softmax(q k^T / sqrt(hd)) v  per local head    (no communication)
         ──> o_i = heads_i W_o,i^T ──g──> y                 one all-reduce (or reduce-scatter)

Heads are dealt out like ``torch.tensor_split(range(num_heads), tp_size)``: 8 heads over 3 ranks
give 3, 3, 2. With grouped-query attention (``num_kv_heads`` < ``num_heads``, MQA at 1) query head h
reads KV head ``h // (num_heads // num_kv_heads)``; each rank holds exactly the KV heads its query
heads read. When there are fewer KV heads than ranks (or the split falls inside a group), some KV
heads are held by several ranks: each such rank computes the KV projection itself (no
communication in forward), and in backward the KV weight gradients are summed over the ranks that
hold each head with one all-reduce, so every copy gets the dense gradient.

Context parallelism (``cp_group``): the sequence itself split over the CP ranks, each holding
its load-balanced chunks and all-gathering the keys and values it reads
(``context_parallel.py``; unpacked causal rows on CPU without a mask: ``cp_causal.py``); the
heads stay split over TP as above.

A batch of prompts of different lengths is left-padded: ``padded_causal_mask`` gives the boolean
mask that keeps every query off the padding (generation only; training takes the fused causal path,
no mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.context import cp_chunk_ranges
from tensorpar.parallel.fused import fused_column
from tensorpar.parallel.linear import ColumnParallelLinear, RowParallelLinear, column_linears
from tensorpar.parallel.mappings import sum_shared_shard_grads
from tensorpar.parallel.sharding import ShardSpec, shard_range
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.transformer.context_parallel import (
    CPSequence,
    check_cp_input,
    cp_attention_mask,
    cp_keys_values,
    cp_rope,
    cp_size,
    example_ids,
)
from tensorpar.transformer.cp_causal import cp_causal_attention, cp_causal_supported
from tensorpar.transformer.kv_cache import LayerKVCache
from tensorpar.transformer.rotary import apply_rotary


def head_shards(num_heads: int, num_kv_heads: int, n: int, rank: int):
    """Query heads [h0, h1) and KV heads [k0, k1) of ``rank``, and whether any KV head is shared.

    Raises ValueError when the heads cannot be split.
    """
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if num_heads < n:
        raise ValueError(f"num_heads={num_heads} cannot be split over {n} ranks: every rank "
                         f"needs at least one query head (use tp_size <= {num_heads})")
    group_size = num_heads // num_kv_heads

    def kv_range(r: int) -> tuple[int, int]:
        h0, h1 = shard_range(num_heads, n, r)
        return h0 // group_size, (h1 - 1) // group_size + 1

    ranges = [kv_range(r) for r in range(n)]
    shared = any(ranges[r][1] > ranges[r + 1][0] for r in range(n - 1))
    return shard_range(num_heads, n, rank), ranges[rank], shared


def padded_causal_mask(valid_BS: torch.Tensor, T: int) -> torch.Tensor:
    """(B, 1, T, S) bool, True where a query may read a key, for the last T of S positions.

    valid_BS: True at real tokens, False at padding. Query i sits at position S - T + i and reads
    the real keys at or before it; a padding query reads only itself, so no row is empty (an
    all-masked row would make NaN that later layers carry into the padding's keys).
    """
    S = valid_BS.shape[1]
    q_pos = torch.arange(S - T, S, device=valid_BS.device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=valid_BS.device)[None, :]  # (1, S)
    mask = (k_pos <= q_pos) & (valid_BS[:, None, :] | (k_pos == q_pos))  # (B, T, S)
    return mask[:, None]


def packed_causal_mask(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where a query may read a key, for rows of packed examples whose
    positions restart at 0 at each example: causal within an example, nothing across two (the
    block-diagonal mask)."""
    T = position_ids_BT.shape[1]
    example_BT = example_ids(position_ids_BT)  # which example each token is in
    pos = torch.arange(T, device=position_ids_BT.device)
    same = example_BT[:, :, None] == example_BT[:, None, :]  # (B, T, T)
    return (same & (pos[None, :] <= pos[:, None]))[:, None]


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention (MHA, GQA, MQA) with its heads split across the TP group.

    dim: model width. num_heads, num_kv_heads: query and key/value head counts (GQA when fewer KV
    heads; default num_heads). head_dim: default dim // num_heads. causal: mask future tokens.
    sequence_parallel: input and output are sequence shards (B, T/n, dim).
    fused: Q, K and V as one autograd op whose backward all-reduce is overlapped with the
        weight-gradient matmuls, and the output projection reducing its product in place
        (``parallel/fused.py``); the same numbers and collectives.
    keep_gathered_input: under SP, Q, K and V keep the all-gathered (B, T, dim) input for
        backward; by default they keep this rank's (B, T/n, dim) shard and all-gather it again in
        backward, overlapped with the input-gradient matmul (one more all-gather, 1/n the memory).
    cp_group: the context-parallel group (None: no CP; not the world): the input is this rank's
        ``split_to_cp`` chunks of the sequence and ``forward`` takes ``context=CPSequence(...)``.
        With sequence parallelism too, the input is this TP rank's ``tensor_split`` shard of
        those chunks and ``seq_len`` their count (the TP all-gather restores the CP rank's
        chunks, the output's reduce-scatter splits them again).
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, causal: bool = True,
                 sequence_parallel: bool = False, group: ProcessGroup | None = None,
                 *, device=None, dtype=None, fused: bool = False,
                 keep_gathered_input: bool = False, cp_group: ProcessGroup | None = None):
        super().__init__()
        self.cp_group = cp_group
        kv_heads = num_kv_heads or num_heads
        n, rank = tp_size(group), tp_rank(group)
        (h0, h1), (k0, k1), shared = head_shards(num_heads, kv_heads, n, rank)
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim={dim} does not divide by num_heads={num_heads}; "
                                 "pass head_dim")
            head_dim = dim // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.causal, self.sequence_parallel, self.group = causal, sequence_parallel, group
        self.fused, self.keep_gathered_input = fused, keep_gathered_input
        self.heads, self.kv_heads, self.kv_shared = (h0, h1), (k0, k1), shared
        hd, kw = head_dim, {"bias": bias, "group": group, "device": device, "dtype": dtype}
        self.q_proj = ColumnParallelLinear(dim, num_heads * hd, out_range=(h0 * hd, h1 * hd), **kw)
        self.k_proj = ColumnParallelLinear(dim, kv_heads * hd, out_range=(k0 * hd, k1 * hd), **kw)
        self.v_proj = ColumnParallelLinear(dim, kv_heads * hd, out_range=(k0 * hd, k1 * hd), **kw)
        self.o_proj = RowParallelLinear(num_heads * hd, dim, in_range=(h0 * hd, h1 * hd),
                                        sequence_parallel=sequence_parallel, fused=fused, **kw)
        # local query head j reads local KV head kv_index[j]
        group_size = num_heads // kv_heads
        kv_index = torch.arange(h0, h1) // group_size - k0
        if device is not None and torch.device(device).type != "meta":
            kv_index = kv_index.to(device)
        self.register_buffer("kv_index", kv_index, persistent=False)
        # when every local KV head serves the same number of local query heads (the split falls
        # on group boundaries, or inside one group), K and V are repeated like the dense model
        # does (a broadcast copy; its backward a sum), not gathered by kv_index (whose backward
        # is a scatter-add: atomics on a GPU)
        reads = [(h // group_size - k0) for h in range(h0, h1)]
        counts = {reads.count(j) for j in range(k1 - k0)}
        self._kv_repeat = counts.pop() if len(counts) == 1 else None
        # where this rank's K/V rows sit in the dense K/V (kept here, not read off the
        # parameters: FSDP2's gathered parameters carry no tag)
        self.kv_spec = ShardSpec(0, k0 * hd, k1 * hd, kv_heads * hd)

    @classmethod
    def from_dense(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, num_heads: int,
                   num_kv_heads: int | None = None, causal: bool = True,
                   sequence_parallel: bool = False, group: ProcessGroup | None = None,
                   fused: bool = False, keep_gathered_input: bool = False,
                   cp_group: ProcessGroup | None = None):
        """Shard dense projections q (dim -> H*hd), k and v (dim -> Hkv*hd), o (H*hd -> dim)."""
        kv_heads = num_kv_heads or num_heads
        head_shards(num_heads, kv_heads, tp_size(group), tp_rank(group))  # validates the counts
        if q.out_features % num_heads:
            raise ValueError(f"q projection has {q.out_features} outputs, not a multiple of "
                             f"num_heads={num_heads}")
        hd = q.out_features // num_heads
        dim = q.in_features
        shapes = {"k": (k.in_features, k.out_features), "v": (v.in_features, v.out_features),
                  "o": (o.out_features, o.in_features)}
        for name, shape in shapes.items():
            if shape != (dim, (num_heads if name == "o" else kv_heads) * hd):
                raise ValueError(
                    f"{name} projection is {shape[0]}<->{shape[1]}, expected "
                    f"{dim}<->{(num_heads if name == 'o' else kv_heads) * hd} for dim={dim}, "
                    f"num_heads={num_heads}, num_kv_heads={kv_heads}, head_dim={hd}")
        attn = cls(dim, num_heads, kv_heads, hd, bias=False, causal=causal,
                   sequence_parallel=sequence_parallel, group=group, device="meta",
                   dtype=q.weight.dtype, fused=fused, keep_gathered_input=keep_gathered_input,
                   cp_group=cp_group)
        for mine, dense in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v),
                            (attn.o_proj, o)):
            mine.load_dense(dense.weight, dense.bias)
        attn.kv_index = attn.kv_index.to(q.weight.device)
        return attn

    def _kv_params(self) -> list[torch.Tensor | None]:
        """[wk, wv, bk, bv] (biases may be None); with shared KV heads, their gradients are
        summed over the ranks that hold each head."""
        params = [self.k_proj.weight, self.v_proj.weight, self.k_proj.bias, self.v_proj.bias]
        if not self.kv_shared:
            return params
        return sum_shared_shard_grads(params, self.group, self.kv_spec)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerKVCache | None = None,
                attn_mask: torch.Tensor | None = None,
                seq_len: int | None = None, *,
                context: CPSequence | None = None) -> torch.Tensor:
        """x: (B, T, dim), or under SP rank r's (B, T_r, dim) ``tensor_split`` shard of the T
        tokens, ``seq_len`` being T (without it the ranks exchange their sizes first). rope:
        rotary (cos, sin) tables for the T positions (see ``rotary_table``). cache: this
        layer's KV cache when decoding; the new positions follow the cached ones. attn_mask:
        (B, 1, T, S) bool over the S = cached + T keys, True where a query may read a key; it
        replaces the causal rule (a padded batch: ``padded_causal_mask``). context: under CP,
        the whole sequence x's chunks belong to (its length, the packed position ids); rope
        then covers all of its positions."""
        if x.dim() != 3 or x.shape[-1] != self.q_proj.in_features:
            raise ValueError(f"ParallelSelfAttention: expected input (B, T, "
                             f"{self.q_proj.in_features}), got {tuple(x.shape)}")
        cp = cp_size(self.cp_group) > 1
        if cp:
            if cache is not None or attn_mask is not None:
                raise ValueError("ParallelSelfAttention: context parallelism takes no KV cache "
                                 "and no attn_mask (packed examples: context.position_ids)")
            # under SP x is this TP rank's shard of the CP rank's seq_len tokens (the split
            # over TP of the CP chunks: norms and dropout per token, attention as without SP)
            check_cp_input(x, context, rope, self.cp_group,
                           tokens=seq_len if self.sequence_parallel else None)
            rope = cp_rope(rope, context.seq_len, self.cp_group) if rope is not None else None
        wk, wv, bk, bv = self._kv_params()
        column = fused_column if self.fused else column_linears  # f, then the Q, K, V matmuls
        q, k, v = column(x, [self.q_proj.weight, wk, wv], [self.q_proj.bias, bk, bv],
                         sequence_parallel=self.sequence_parallel, group=self.group,
                         keep_gathered_input=self.keep_gathered_input, seq_len=seq_len)
        B, T = q.shape[:2]
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        # q: (B, h_local, T, hd); k, v: (B, kv_local, T, hd)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)  # (B, kv_local, past + T, hd)
        chunks = None  # under CP, unpacked causal rows on CPU: no mask (``cp_causal.py``)
        if cp and self.causal and context.position_ids is None and cp_causal_supported(q):
            chunks = cp_chunk_ranges(context.seq_len, cp_size(self.cp_group),
                                     tp_rank(self.cp_group))
        if cp:  # every CP rank's keys: (B, kv_local, seq_len, hd), rank or sequence order
            k, v = cp_keys_values(k, v, context.seq_len, self.cp_group, in_order=bool(chunks))
            if chunks is None:  # packed rows, or not on CPU: the mask of global positions
                attn_mask = cp_attention_mask(context, self.cp_group, self.causal, x.device)
        if self._kv_repeat is None:  # uneven: some local KV heads serve more query heads
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        elif self._kv_repeat > 1 and not chunks:  # (B, kv_local, S, hd) -> (B, h_local, S, hd)
            k = k.repeat_interleave(self._kv_repeat, dim=1)
            v = v.repeat_interleave(self._kv_repeat, dim=1)
        if chunks:  # the kernel groups the query heads of each KV head (no repeat)
            y = cp_causal_attention(q, k, v, chunks)  # (B, h_local, T_i, hd)
        else:
            y = self._sdpa(q, k, v, attn_mask, past, x.device)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, h_local * hd)
        return self.o_proj(y)

    def _sdpa(self, q, k, v, attn_mask, past: int, device) -> torch.Tensor:
        """SDPA of q (B, h, T, hd) against k, v (B, h, S, hd): the causal rule, a decoding
        step's (the queries after ``past`` cached keys) or ``attn_mask``."""
        T = q.shape[2]
        causal, mask = self.causal, None
        if attn_mask is not None:
            if attn_mask.shape[-2:] != (T, k.shape[2]):  # (under CP, built above: it fits)
                raise ValueError(f"attn_mask covers {tuple(attn_mask.shape[-2:])} (queries, keys); "
                                 f"expected ({T}, {k.shape[2]})")
            causal, mask = False, attn_mask
        elif past and self.causal:
            # queries sit at positions past .. past+T-1, keys at 0 .. past+T-1
            causal = False
            if T > 1:
                keys = torch.arange(past + T, device=device)
                mask = keys[None, :] <= torch.arange(past, past + T, device=device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads} (heads {self.heads[0]}:{self.heads[1]} here), "
                f"num_kv_heads={self.num_kv_heads} (kv heads {self.kv_heads[0]}:"
                f"{self.kv_heads[1]} here{', shared' if self.kv_shared else ''}), "
                f"head_dim={self.head_dim}, causal={self.causal}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (", keep_gathered_input=True" if self.keep_gathered_input else "")
                + (f", cp={cp_size(self.cp_group)}" if cp_size(self.cp_group) > 1 else ""))
