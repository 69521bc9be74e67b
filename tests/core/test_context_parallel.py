"""Context-parallel attention against full attention on one rank: output, input gradient, every
weight gradient, at any (tp, cp) grid, with rotary positions, GQA and packed examples; the
collectives counted against ``attention_collective_counts``.

Layouts on n = tp x cp ranks, rank = c * tp + t: TP groups are consecutive ranks (they hold the
same tokens), CP groups the ranks t, t + tp, ... (they hold different chunks of the sequence).
The reference runs the whole sequence in one process; a weight's gradient summed over the CP
ranks (as the trainer's gradient reduction over dp x cp will) equals its gradient.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar import ParallelSelfAttention
from tensorpar.cli.compare import dense_shard, max_rel_error
from tensorpar.parallel.context import (
    check_cp_split,
    cp_chunk_ranges,
    cp_sizes,
    cp_token_index,
    gather_from_cp,
    split_to_cp,
)
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.transformer.attention import head_shards
from tensorpar.transformer.context_parallel import CPSequence, attention_collective_counts
from tensorpar.transformer.reference import DenseAttention
from tensorpar.transformer.rotary import rotary_table, rotary_table_at

B, D, HD = 2, 24, 4
# the largest relative error of the output, the input gradient and every weight gradient:
# ~10x the largest measured over every layout here (torch 2.13 CPU)
TOL = 5e-6  # measured 5.4e-7 (a V weight gradient, tp 2 cp 2)
PACKED = [[7, 11, 12], [30]]  # example lengths per row: boundaries inside chunks, one row whole
_GROUPS: dict = {}


def _groups(tp: int, cp: int):
    """(tp_group, cp_group) of this rank; collective on first use, cached per process (every
    rank asks for the same layouts in the same order)."""
    n = dist.get_world_size()
    assert n == tp * cp, (n, tp, cp)
    if (tp, cp) not in _GROUPS:
        tp_group = dist.new_subgroups_by_enumeration(
            [list(range(c * tp, c * tp + tp)) for c in range(cp)])[0]
        cp_group = dist.new_subgroups_by_enumeration(
            [list(range(t, n, tp)) for t in range(tp)])[0]
        _GROUPS[tp, cp] = tp_group, cp_group
    return _GROUPS[tp, cp]


def _packed_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def _reference(dense: DenseAttention, x: torch.Tensor, lengths_per_row) -> torch.Tensor:
    """Full attention on one rank: each row whole, or each packed example alone (its own
    positions from 0), so nothing can read across an example by construction."""
    if lengths_per_row is None:
        return dense(x, rotary_table(HD, 0, x.shape[1]))
    rows = []
    for b, lengths in enumerate(lengths_per_row):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        rows.append(torch.cat([dense(x[b:b + 1, a:a + n], rotary_table(HD, 0, n))
                               for a, n in zip(starts, lengths, strict=True)], 1))
    return torch.cat(rows)


def _body(tp, cp, heads, kv_heads, T, packed):
    """Errors of the output, the input gradient and each weight gradient; the collectives."""
    tp_group, cp_group = _groups(tp, cp)
    torch.manual_seed(0)
    dense = DenseAttention(D, heads, kv_heads, head_dim=HD)
    attn = ParallelSelfAttention.from_dense(dense.q_proj, dense.k_proj, dense.v_proj,
                                            dense.o_proj, heads, kv_heads, group=tp_group,
                                            cp_group=cp_group)
    x = torch.randn(B, T, D)
    lengths = [PACKED[0], [T]] if packed else None
    pos = _packed_positions(lengths) if packed else None
    x_ref = x.clone().requires_grad_(True)
    y_ref = _reference(dense, x_ref, lengths)
    grad_y = torch.randn_like(y_ref)
    y_ref.backward(grad_y)

    rope = rotary_table_at(HD, pos) if packed else rotary_table(HD, 0, T)
    x_cp = split_to_cp(x, cp_group).requires_grad_(True)
    with CollectiveCounter() as fwd:
        y = attn(x_cp, rope, context=CPSequence(T, pos))
    with CollectiveCounter() as bwd:
        y.backward(split_to_cp(grad_y, cp_group))
    errors = {"output": max_rel_error(y, split_to_cp(y_ref, cp_group)),
              "input grad": max_rel_error(x_cp.grad, split_to_cp(x_ref.grad, cp_group))}
    dense_params = dict(dense.named_parameters())
    for name, p in attn.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_group)  # the CP ranks' shares of the tokens
        errors[f"grad {name}"] = max_rel_error(grad, dense_shard(dense_params[name].grad,
                                                                 p.tp_shard))
    return errors, {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}


def _run(ranks, tp, cp, heads, kv_heads, T=30, packed=False):
    results = ranks(tp * cp).run(_body, tp, cp, heads, kv_heads, T, packed)
    shared = head_shards(heads, kv_heads, tp, 0)[2]
    want = attention_collective_counts(tp, cp, shared)
    for rank, (errors, counts) in enumerate(results):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"rank {rank}: {worst} off by {errors[worst]:.2e}"
        assert counts == want, f"rank {rank}: {counts} != {want}"


def test_cp2(ranks):
    """cp 2 on 30 tokens (chunks 8, 8, 7, 7), GQA: equal to full attention on one rank."""
    _run(ranks, 1, 2, 4, 2)


def test_cp2_packed(ranks):
    """Packed examples at cp 2: example boundaries fall inside chunks and across the ranks'
    chunks; no query reads another example's keys and positions restart per example."""
    _run(ranks, 1, 2, 4, 2, packed=True)


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_cp4_uneven(ranks, heads, kv_heads):
    """cp 4 on 30 tokens: 8 chunks of 4, 4, 4, 4, 4, 4, 3, 3 (ranks hold 7, 7, 8, 8)."""
    _run(ranks, 1, 4, heads, kv_heads)


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads,packed", [(4, 2, False), (4, 1, False), (6, 2, True)],
                         ids=["gqa", "mqa-shared-kv", "packed-uneven-heads"])
def test_tp2_cp2(ranks, heads, kv_heads, packed):
    """(tp 2, cp 2): heads split over TP (KV heads shared by both TP ranks under MQA, their
    gradient summed), the sequence over CP."""
    _run(ranks, 2, 2, heads, kv_heads, packed=packed)


@pytest.mark.slow
def test_tp3_cp2_uneven_heads(ranks):
    """(tp 3, cp 2), 8 query heads over 2 KV heads: the heads split 3, 3, 2, so TP rank 1's
    KV heads serve 1 and 2 of its query heads; the mask-free path then reads K and V per query
    head (index_select), and stays exact."""
    _run(ranks, 3, 2, 8, 2)


def test_load_balance_order():
    """Rank i of N holds chunks i and 2N-1-i of 2N, cut as tensor_split cuts; the causal
    triangle's (query, key) pairs split evenly (exactly when 2N divides T)."""
    assert cp_chunk_ranges(30, 2, 0) == [(0, 8), (23, 30)]
    assert cp_chunk_ranges(30, 2, 1) == [(8, 16), (16, 23)]
    assert cp_chunk_ranges(30, 4, 1) == [(4, 8), (24, 27)]
    assert cp_sizes(30, 4) == [7, 7, 8, 8] and cp_chunk_ranges(9, 1, 0) == [(0, 9)]
    for T, n in ((32, 2), (4096, 8), (30, 2), (30, 4)):
        pairs = [int((cp_token_index(T, n, r) + 1).sum()) for r in range(n)]  # keys read
        if T % (2 * n) == 0:
            assert len(set(pairs)) == 1, (T, n, pairs)
        else:  # uneven chunks (ranks hold 7, 7, 8, 8 of 30): off by at most two rows of keys
            assert max(pairs) - min(pairs) <= 2 * T, (T, n, pairs)  # a split by rank: 153
    # every token on exactly one rank
    assert sorted(torch.cat([cp_token_index(30, 4, r) for r in range(4)]).tolist()) == list(
        range(30))


def _split_gather_body(T):
    _, cp_group = _groups(1, dist.get_world_size())
    x = torch.arange(B * T, dtype=torch.float64).view(B, T, 1)
    mine = split_to_cp(x, cp_group).requires_grad_(True)
    whole = gather_from_cp(mine, T, cp_group)
    (whole * torch.arange(T, dtype=torch.float64)[None, :, None]).sum().backward()
    expected_grad = split_to_cp(torch.arange(T, dtype=torch.float64)[None], cp_group)[0]
    return bool(torch.equal(whole, x)), bool(torch.equal(mine.grad[0, :, 0], expected_grad))


def test_split_and_gather_back(ranks):
    """gather_from_cp puts every rank's chunks back in sequence order; its backward hands each
    rank its chunks' gradient."""
    for same, grad_ok in ranks(2).run(_split_gather_body, 11):
        assert same and grad_ok


def _refused_body(case):
    """The refusal's message on this rank, and the collectives issued before it (none)."""
    _, cp_group = _groups(1, dist.get_world_size())
    torch.manual_seed(0)
    attn = ParallelSelfAttention(D, 4, 2, HD, group=_groups(1, 2)[0], cp_group=cp_group)
    x = torch.randn(B, 3, D)
    try:
        with CollectiveCounter() as counter:
            if case == "short":  # 2 CP ranks cut the sequence into 4 chunks
                attn(x, context=CPSequence(3))
            elif case == "tokens":  # 30 tokens give each rank 15
                attn(x, context=CPSequence(30))
            elif case == "positions":
                attn(torch.randn(B, 15, D), context=CPSequence(30, torch.zeros(B, 29)))
            else:
                attn(torch.randn(B, 15, D))
    except ValueError as e:
        return str(e), dict(counter.counts)
    return None, dict(counter.counts)


@pytest.mark.parametrize("case,words", [
    ("short", "3 tokens cannot be cut into 4 chunks for 2 CP ranks"),
    ("tokens", "CP rank . holds 3 tokens, but seq_len=30 over 2 CP ranks gives it 15"),
    ("positions", r"position_ids are \(2, 29\), expected the whole rows \(2, 30\)"),
    ("context", "needs context=CPSequence"),
])
def test_refused_on_every_rank_before_any_collective(ranks, case, words):
    """Every rank raises the same one line, having issued no collective (none hangs)."""
    import re

    for message, counts in ranks(2).run(_refused_body, case):
        assert message is not None and re.search(words, message) and "\n" not in message, message
        assert counts == {}


def test_split_refused_in_one_line():
    with pytest.raises(ValueError, match="7 tokens cannot be cut into 8 chunks") as e:
        check_cp_split(7, 4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n,heads,kv_heads", [(2, 4, 2), (4, 4, 1), (4, 3, 3)])
def test_causal_chunks_merge_equals_one_causal_call(n, heads, kv_heads):
    """The mask-free path (``cp_causal_attention``), in float64 in one process: each CP rank's
    chunks, two kernel calls each merged by log-sum-exp, give the rows of one causal SDPA call
    over the whole sequence, and their q gradients its rows, their K and V gradients summed
    over the ranks its own, to float64 rounding (1e-13 absolute; measured under 3e-15)."""
    import torch.nn.functional as F

    from tensorpar.transformer.cp_causal import cp_causal_attention

    T = 30
    torch.manual_seed(0)
    q = torch.randn(B, heads, T, HD, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv_heads, T, HD, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv_heads, T, HD, dtype=torch.float64, requires_grad=True)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(n):
        mine = cp_token_index(T, n, rank)
        q_i = q.detach()[:, :, mine].requires_grad_(True)
        k_i, v_i = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
        y_i = cp_causal_attention(q_i, k_i, v_i, cp_chunk_ranges(T, n, rank))
        y_i.backward(grad_y[:, :, mine])
        errors = [(y_i - y[:, :, mine]).abs().max(), (q_i.grad - q.grad[:, :, mine]).abs().max()]
        assert max(errors) <= 1e-13, (rank, errors)
        dk, dv = dk + k_i.grad, dv + v_i.grad
    errors = [(dk - k.grad).abs().max(), (dv - v.grad).abs().max()]
    assert max(errors) <= 1e-13, errors
