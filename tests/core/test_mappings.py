"""The conjugate collective pairs: forward, backward and collective count at every world size."""

import re

import pytest
import torch

import tensorpar as tp
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import tp_rank, tp_size

from tests_common import WORLD_SIZES
from tp_check import assert_close, shard

B, D = 2, 10  # D = 10 splits unevenly over 3 and 4 ranks
T = 13  # tokens: uneven sequence shards over 2, 3 and 4 ranks (7 + 6; 5 + 4 + 4; 4 + 3 + 3 + 3)
# a sum over the ranks (gloo's order) against torch's .sum(0): ~10x the largest relative error
# measured over TP=1-4, 1.0e-7 (the sequence reduce-scatter at TP=4; 2026-11-27, torch 2.13
# CPU). What only moves data (identity, split, gather) is compared bit for bit.
SUM_TOL = 1e-6


def _run(op, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    before = x.detach().clone()
    with CollectiveCounter() as fwd:
        y = op(x)
    with CollectiveCounter() as bwd:
        y.backward(grad_out)
    assert torch.equal(x.detach(), before), "the input was modified in place"
    return y, x.grad, {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}


def _pairs_body(T):
    """Each pair against what it must compute; runs on every rank."""
    n, r = tp_size(), tp_rank()
    torch.manual_seed(0)  # the same draws on every rank
    full, grad = torch.randn(B, T, D), torch.randn(B, T, D)
    all_partials = torch.randn(n, B, T, D)
    per_rank = all_partials[r]  # each rank's partial sum
    grads_all = torch.randn(n, B, T, D)  # each rank's upstream gradient for replicated outputs
    counts = {}

    # f: identity forward, all-reduce backward
    y, gx, counts["copy"] = _run(tp.copy_to_tp, full, grads_all[r])
    assert torch.equal(y, full), "copy fwd"
    assert_close("copy bwd", gx, grads_all.sum(0), SUM_TOL)

    # g: all-reduce forward, identity backward
    y, gx, counts["reduce"] = _run(tp.reduce_from_tp, per_rank, grad)
    assert_close("reduce fwd", y, all_partials.sum(0), SUM_TOL)
    assert torch.equal(gx, grad), "reduce bwd"

    # gather last dim (uneven shards): all-gather forward, split backward
    y, gx, counts["gather"] = _run(lambda x: tp.gather_from_tp(x, full_size=D), shard(full, -1),
                                   grad)
    assert torch.equal(y, full), "gather fwd"
    assert torch.equal(gx, shard(grad, -1)), "gather bwd"

    # scatter last dim: split forward, all-gather backward
    y, gx, counts["scatter"] = _run(tp.scatter_to_tp, full, shard(grad, -1))
    assert torch.equal(y, shard(full, -1)), "scatter fwd"
    assert torch.equal(gx, grad), "scatter bwd"

    # sequence gather: all-gather forward, reduce-scatter backward; told T, or exchanging sizes
    for name, seq_len in (("seq_gather", T), ("seq_gather_exchanged", None)):
        y, gx, counts[name] = _run(lambda x, s=seq_len: tp.gather_from_sequence(x, seq_len=s),
                                   shard(full, 1), grads_all[r])
        assert torch.equal(y, full), "seq gather fwd"
        assert_close("seq gather bwd", gx, shard(grads_all.sum(0), 1), SUM_TOL)

    # sequence reduce-scatter: reduce-scatter forward, all-gather backward
    y, gx, counts["seq_rs"] = _run(tp.reduce_scatter_to_sequence, per_rank, shard(grad, 1))
    assert_close("seq reduce-scatter fwd", y, shard(all_partials.sum(0), 1), SUM_TOL)
    assert torch.equal(gx, grad), "seq reduce-scatter bwd"

    # sequence scatter: split forward, all-gather backward
    y, gx, counts["seq_scatter"] = _run(tp.scatter_to_sequence, full, shard(grad, 1))
    assert torch.equal(y, shard(full, 1)), "seq scatter fwd"
    assert torch.equal(gx, grad), "seq scatter bwd"
    return counts


EXPECTED = {
    "copy": ({}, {"all_reduce": 1}),
    "reduce": ({"all_reduce": 1}, {}),
    "gather": ({"all_gather": 1}, {}),
    "scatter": ({}, {"all_gather": 1}),
    "seq_gather": ({"all_gather": 1}, {"reduce_scatter": 1}),
    "seq_gather_exchanged": ({"all_gather": 2}, {"reduce_scatter": 1}),  # + the sizes
    "seq_rs": ({"reduce_scatter": 1}, {"all_gather": 1}),
    "seq_scatter": ({}, {"all_gather": 1}),
}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_conjugate_pairs(ranks, n):
    """Every pair computes its collective in forward and the conjugate in backward, out of place,
    with exactly one collective where one is due (none at world size 1), on uneven
    (``tensor_split``) shards of the last dim and of the sequence alike (even ones: every SP test
    of the layers and the GPT)."""
    for counts in ranks(n).run(_pairs_body, T):
        for name, (fwd, bwd) in EXPECTED.items():
            want = ({}, {}) if n == 1 else (fwd, bwd)
            assert (counts[name]["forward"], counts[name]["backward"]) == want, name


def _sum_grads_body():
    n, r = tp_size(), tp_rank()
    w = torch.full((3,), float(r + 1), requires_grad=True)
    b = torch.full((2,), 10.0 * (r + 1), requires_grad=True)
    w2, b2 = tp.sum_grads_in_backward([w, b])
    with CollectiveCounter() as bwd:
        ((w2 * (r + 1)).sum() + (b2 * 2).sum()).backward()
    total = sum(range(1, n + 1))
    assert torch.equal(w.grad, torch.full((3,), float(total)))  # sum over ranks of (r + 1)
    assert torch.equal(b.grad, torch.full((2,), 2.0 * n))
    return dict(bwd.counts)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sum_grads_in_backward(ranks, n):
    """Gradients of replicated tensors are summed over the group with a single all-reduce."""
    for counts in ranks(n).run(_sum_grads_body):
        assert counts == ({} if n == 1 else {"all_reduce": 1})


def _gather_any_sizes_body():
    n, r = tp_size(), tp_rank()
    sizes = [1 + (2 * k) % 3 for k in range(n)]  # 1, 3, 2, 1: not tensor_split's order
    torch.manual_seed(0)
    full, grad = torch.randn(2, sum(sizes)), torch.randn(2, sum(sizes))
    start = sum(sizes[:r])
    piece = full[:, start : start + sizes[r]]
    y, gx, counts = _run(tp.gather_from_tp, piece, grad)  # no full_size: sizes exchanged
    assert torch.equal(y, full), "gather fwd"
    assert torch.equal(gx, grad[:, start : start + sizes[r]]), "gather bwd"
    return counts


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gather_without_full_size_takes_any_shard_sizes(ranks, n):
    """Without full_size the shard sizes are exchanged first (one small all-gather), so uneven
    shards in any order gather correctly instead of aborting gloo."""
    for counts in ranks(n).run(_gather_any_sizes_body):
        assert counts == {"forward": {"all_gather": 2}, "backward": {}}


def _sequence_refused_body():
    n, r = tp_size(), tp_rank()
    short = torch.randn(2, n - 1, 4)  # fewer tokens than ranks
    for op in (tp.reduce_scatter_to_sequence, tp.scatter_to_sequence):
        with pytest.raises(ValueError, match=f"sequence length {n - 1} is shorter than the TP "
                                             f"size {n}"):
            op(short)
    # shards that are not tensor_split's: refused on every rank once the sizes are exchanged
    held = [1 + (k == n - 1) for k in range(n)]  # the last rank holds the larger one
    with pytest.raises(ValueError, match=re.escape(f"the ranks hold {held} tokens")):
        tp.gather_from_sequence(torch.randn(2, held[r], 4))
    # told a length whose split gives every rank one token more than it holds
    with pytest.raises(ValueError, match=f"rank {r} holds 2 tokens, but a split of "
                                         f"seq_len={3 * n} over {n} ranks gives it 3"):
        tp.gather_from_sequence(torch.randn(2, 2, 4), seq_len=3 * n)
    with pytest.raises(ValueError, match="holds 3 of the last dim"):
        tp.gather_from_tp(torch.randn(2, 3), full_size=4 * tp_size() + 1)
    return True


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sequence_shards_refused(ranks, n):
    """Fewer tokens than ranks, or shards that are not ``tensor_split``'s, are refused on every
    rank with the numbers, never a gloo abort (the pool stays healthy: every rank returned)."""
    assert ranks(n).run(_sequence_refused_body) == [True] * n
    assert ranks(n).run(_pairs_body, 13)  # the group still works afterwards


def test_identity_without_process_group():
    """With torch.distributed not initialized every wrapper returns its input: world size 1."""
    x = torch.randn(2, 4, 6)
    for op in (tp.copy_to_tp, tp.reduce_from_tp, tp.gather_from_tp, tp.scatter_to_tp,
               tp.gather_from_sequence, tp.reduce_scatter_to_sequence, tp.scatter_to_sequence):
        assert op(x) is x
