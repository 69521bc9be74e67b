"""Vocab-parallel embedding and cross-entropy against nn.Embedding and F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import VocabParallelEmbedding, vocab_parallel_cross_entropy
from tensorpar.cli.compare import dense_shard
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import tp_rank, tp_size

from tests_common import WORLD_SIZES
from tp_check import assert_close, counts_ok, leaf, shard

B, T, V, D = 2, 12, 37, 8  # 37 splits unevenly over 2, 3 and 4 ranks
# the largest relative error allowed, ~10x the largest measured over TP=1-4 and each test's
# cases (2026-11-27, torch 2.13 CPU); the embedding is compared bit for bit (a lookup on one
# rank, zeros from the others)
TOL = {"loss": 1.5e-6,  # measured 1.1e-7 (label smoothing 0.2, ignore_index 3, TP=2)
       "logits grad": 1e-5,  # measured 9.7e-7 (reduction "sum", TP=3)
       "padded loss": 1e-6,  # measured 0 (-inf columns); the floor: a few fp32 ulps
       "padded grad": 1.5e-6}  # measured 1.6e-7 (-inf columns, TP=2)


def _embedding_body(sequence_parallel, padding_idx):
    torch.manual_seed(0)
    dense = nn.Embedding(V, D, padding_idx=padding_idx)
    layer = VocabParallelEmbedding.from_dense(dense, sequence_parallel)
    ids = torch.randint(V, (B, T))
    ids[0, :3] = torch.tensor([0, V - 1, padding_idx or 0])  # both ends of the vocabulary
    y = dense(ids)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    out_shard = (lambda t: shard(t, 1)) if sequence_parallel else (lambda t: t)
    with CollectiveCounter() as fwd:
        y_tp = layer(ids)
    with CollectiveCounter() as bwd:
        y_tp.backward(out_shard(grad_y))
    assert torch.equal(y_tp, out_shard(y)), "embedding output"
    assert torch.equal(layer.weight.grad, dense_shard(dense.weight.grad, layer.weight.tp_shard))
    return {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("sp,padding_idx", [(False, None), (True, None), (False, 5)])
def test_vocab_parallel_embedding(ranks, n, sp, padding_idx):
    """Each id is looked up on the one rank that owns it; one all-reduce (reduce-scatter under SP)
    gives the dense lookup; the padding row gets no gradient, as in nn.Embedding."""
    results = ranks(n).run(_embedding_body, sp, padding_idx)
    if n == 1:
        return counts_ok(results, {}, {})
    counts_ok(results, {"reduce_scatter": 1} if sp else {"all_reduce": 1},
              {"all_gather": 1} if sp else {})


CE_CASES = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"label_smoothing": 0.2, "ignore_index": 3, "reduction": "mean"},
    {"ignore_index": -100, "reduction": "none"},
]


# how the caller passes the vocabulary: the ranks send their slice sizes (None), the caller
# names it (no host read-back), and with that gives its float32 logits up (reuse_logits: their
# buffer becomes exp(z - max), then the gradient)
CE_MODES = {"sizes sent": {}, "vocab_size": {"vocab_size": V},
            "reuse_logits": {"vocab_size": V, "reuse_logits": True}}


def _cross_entropy_body(kwargs, shape):
    torch.manual_seed(0)
    logits = torch.randn(*shape, V) * 3
    target = torch.randint(V, shape)
    ignore = kwargs.get("ignore_index", -100)
    target.view(-1)[::5] = ignore  # some ignored tokens
    dense_logits = leaf(logits)
    ref = F.cross_entropy(dense_logits.reshape(-1, V), target.reshape(-1), **kwargs)
    ref = ref.view(shape) if kwargs.get("reduction") == "none" else ref
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    counts = {}
    for mode, how in CE_MODES.items():
        local = leaf(shard(logits, -1))
        given = local * 1  # not a leaf: what a model's head hands over
        with CollectiveCounter() as fwd:
            loss = vocab_parallel_cross_entropy(given, target, **kwargs, **how)
        with CollectiveCounter() as bwd:
            loss.backward(grad_out)
        assert_close(f"loss ({mode})", loss, ref, TOL["loss"])
        assert_close(f"logits grad ({mode})", local.grad, shard(dense_logits.grad, -1),
                     TOL["logits grad"])
        counts[mode] = {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}
    assert counts["vocab_size"] == counts["reuse_logits"], counts
    return counts


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("kwargs", CE_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in
                                                                   k.items()) or "default")
def test_vocab_parallel_cross_entropy(ranks, n, kwargs):
    """Loss and logits gradient equal F.cross_entropy on the full logits (ignore_index, label
    smoothing, every reduction; the vocabulary sent by the ranks or given, the logits' buffer
    reused or not), with no communication in backward: the logits are never gathered. Forward
    makes one all-gather of per-token statistics, and the target logits travel with them when
    the vocabulary size is given; when the ranks send it, an all-reduce of those follows."""
    for shape in [(B, T), (B * T,)]:
        results = ranks(n).run(_cross_entropy_body, kwargs, shape)
        for mode, extra in [("vocab_size", {}), ("sizes sent", {"all_reduce": 1})]:
            counts_ok([r[mode] for r in results],
                      {} if n == 1 else {"all_gather": 1, **extra}, {})


def _cross_entropy_edge_body():
    # a padded vocabulary: the last columns are -inf; they sit on the last rank(s) only
    torch.manual_seed(0)
    logits = torch.randn(B, T, V)
    logits[..., -4:] = float("-inf")
    target = torch.randint(V - 4, (B, T))
    dense = leaf(logits)
    ref = F.cross_entropy(dense.reshape(-1, V), target.reshape(-1))
    ref.backward()
    local = leaf(shard(logits, -1))
    loss = vocab_parallel_cross_entropy(local, target)
    loss.backward()
    assert torch.isfinite(loss), loss
    assert_close("loss with -inf columns", loss, ref, TOL["padded loss"])
    assert_close("grad with -inf columns", local.grad, shard(dense.grad, -1), TOL["padded grad"])
    # the same with the logits' buffer reused
    local = leaf(shard(logits, -1))
    given = local * 1
    loss = vocab_parallel_cross_entropy(given, target, vocab_size=V, reuse_logits=True)
    loss.backward(retain_graph=True)
    assert_close("loss with -inf columns, reused", loss, ref, TOL["padded loss"])
    assert_close("grad with -inf columns, reused", local.grad, shard(dense.grad, -1),
                 TOL["padded grad"])
    if tp_size() > 1:  # the buffer the gradient was built in is gone: a clear error, not garbage
        assert not torch.equal(given, shard(logits, -1))  # it held exp(z - max), then the grad
        with pytest.raises(RuntimeError, match="backward through the same loss a second time"):
            loss.backward()
    # a target on a -inf column: an infinite loss, as torch's (its gradient is NaN in both)
    on_inf = target.clone()
    on_inf[0, 0] = V - 1
    ref = F.cross_entropy(dense.detach().reshape(-1, V), on_inf.reshape(-1))
    for given in ({}, {"vocab_size": V}):
        loss = vocab_parallel_cross_entropy(shard(logits, -1), on_inf, **given)
        assert loss == ref == float("inf"), (given, loss, ref)
    # every token ignored: torch's mean is NaN but its gradient is zero; ours too, the vocabulary
    # sent by the ranks or given
    for given in ({}, {"vocab_size": V}):
        local = leaf(shard(logits, -1))
        loss = vocab_parallel_cross_entropy(local, torch.full((B, T), -100), **given)
        loss.backward()
        assert torch.isnan(loss) and torch.equal(local.grad, torch.zeros_like(local.grad)), given
    return True


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_cross_entropy_padded_vocab_and_all_ignored(ranks, n):
    """-inf logits (padded vocabulary) give a finite loss equal to torch's; a batch with every
    token ignored gives zero gradients rather than NaN ones."""
    assert all(ranks(n).run(_cross_entropy_edge_body))


def _vocab_errors_body():
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(V, D)
    with pytest.raises(ValueError, match=f"ids range over \\[0, {V}\\], outside the vocabulary "
                                         f"\\[0, {V}\\)"):
        emb(torch.tensor([[0, V]]))
    logits = shard(torch.randn(2, 5, V), -1)
    with pytest.raises(ValueError, match="target shape \\(2, 4\\) does not match logits shape"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=f"target {V} is outside the vocabulary of {V}"):
        vocab_parallel_cross_entropy(logits, torch.full((2, 5), V))
    n, r = tp_size(), tp_rank()
    wrong_order = shard_sizes(V, n)[n - 1 - r]  # uneven shards, smaller first
    with pytest.raises(ValueError, match="not the tensor_split shards"):
        vocab_parallel_cross_entropy(torch.randn(2, 5, wrong_order),
                                     torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="negative target -3"):
        vocab_parallel_cross_entropy(logits, torch.full((2, 5), -3))
    with pytest.raises(ValueError, match=f"num_embeddings=2 cannot be split over {tp_size()}"):
        VocabParallelEmbedding(2, D)
    return True


@pytest.mark.parametrize("n", [3, 4])
def test_vocab_errors_on_every_rank(ranks, n):
    """Out-of-range ids and targets, mismatched shapes: a ValueError naming the numbers on every
    rank (the pool survives, so no rank was left waiting in a collective)."""
    assert all(ranks(n).run(_vocab_errors_body))
