"""Property tests (hypothesis): the parallel layers against their dense references on drawn shapes.

Hypothesis draws the TP size (1-4, the session's rank pools), batch (1-3), sequence length
(1-12), widths, vocabulary and hidden sizes that need not divide by the TP size (uneven
``tensor_split`` shards), sequence parallelism on or off (sequence shards uneven too), and the
layers' options. Every rank builds the dense layer from a drawn seed, shards it with
``from_dense``, runs forward and backward through both (and an fp64 copy of the dense layer),
and returns, for the output, the input gradient and each weight-gradient shard, its error
against the dense fp32 layer relative to the dense tensor's scale; each must be at most its
test's floor (``FLOOR``: ~10x the largest error measured over the test's examples), or 4x the
dense layer's own fp32 error where a tensor is ill-conditioned (``assert_within``). Sizes that
are refused: a ValueError, the same on every rank (``test_properties_refused.py``).

Examples run (``derandomize=True``: the same ones every run; no example database): here
column 60, row 45, embedding 50, cross-entropy 45, norms 50 (250); MLP 45, attention 70,
block 30, GPT 20 (165, ``test_properties_blocks.py``); refused split sizes 18 (all there are),
short SP 15, heads 30, GPT short SP 6 (69, ``test_properties_refused.py``): 484 in all.
The three files take 45 s on 2 CPU cores (80 s when other work shares them), most of it
starting and stopping the four rank pools; with the pools already up, as in the suite, 18 s:

    python -m pytest -q tests/core/test_properties.py tests/core/test_properties_blocks.py \
        tests/core/test_properties_refused.py
"""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tensorpar import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tensorpar.cli.compare import dense_shard

from tp_check import leaf, shard

TP_SIZES = [1, 2, 3, 4]
PROPERTY = {"deadline": None, "derandomize": True, "database": None}
WIDEST = 1e-3  # the most an ill-conditioned tensor may be off (see assert_within)
# each test's floor: ~10x the largest error measured over its examples where the dense fp32 layer
# is well-conditioned (2026-11-27, torch 2.13 CPU); 0: bit for bit
FLOOR = {"column": 2.5e-6,  # measured 2.4e-7 (the input gradient, TP=4)
         "row": 1.5e-6,  # measured 1.6e-7 (the output, TP=3)
         "embedding": 0.0,  # measured 0: a lookup on one rank, zeros from the others
         "cross entropy": 1e-5,  # measured 9.4e-7 (the logits gradient, TP=3)
         "norms": 1.5e-6}  # measured 1.4e-7 (the input gradient, TP=1)


def err(actual: torch.Tensor, expected: torch.Tensor, whole: torch.Tensor) -> float:
    """max |actual - expected| / max |whole|: ``expected`` is this rank's piece of the dense
    tensor ``whole``. Relative to the whole tensor, not to the piece: a piece can hold a
    gradient that nearly cancels (hypothesis found a query head whose q_proj gradient is 1/70
    of the other heads'), of which the dense layer's own fp32 rounding is 5e-5. Zero in exact
    arithmetic (a key bias's gradient cancels in the softmax) is rounding noise: then the
    absolute difference."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    if not expected.numel():
        return 0.0
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    scale = whole.detach().abs().max().item()
    return diff if scale < 1e-6 else diff / scale


def score(actual, ref, exact, piece=lambda t: t) -> tuple[float, float]:
    """(error, own): the error of ``actual`` against its piece of the dense fp32 ``ref``, and the
    dense fp32 layer's own error against the fp64 ``exact`` (``assert_within`` allows four times
    that where it exceeds the test's floor)."""
    return err(actual, piece(ref), ref), err(ref, exact.to(ref.dtype), exact)


def dense_pass(dense: nn.Module, x: torch.Tensor, grad_y=None):
    """Forward and backward through ``dense`` in its dtype: output, input and parameter grads by
    name, and the output gradient used (drawn here when not given: the same on every rank)."""
    dtype = next(dense.parameters()).dtype
    x = leaf(x.to(dtype)) if x.is_floating_point() else x
    y = dense(x)
    grad_y = torch.randn_like(y) if grad_y is None else grad_y.to(y.dtype)
    y.backward(grad_y)
    named = {"output": y.detach(), "input grad": x.grad}
    return named | {f"grad {n}": p.grad for n, p in dense.named_parameters()}, grad_y


def compare(dense: nn.Module, parallel: nn.Module, x: torch.Tensor, in_shard=lambda t: t,
            out_shard=lambda t: t) -> dict[str, tuple[float, float]]:
    """Forward and backward through the dense layer (fp32 and an fp64 copy) and the parallel
    one; the score of the output, the input gradient (a float input) and every gradient shard.
    in_shard / out_shard: this rank's piece of the dense input / output."""
    exact = copy.deepcopy(dense).double()
    ref, grad_y = dense_pass(dense, x)
    ref64, _ = dense_pass(exact, x, grad_y)
    x_tp = leaf(in_shard(x)) if x.is_floating_point() else in_shard(x)
    y_tp = parallel(x_tp)
    y_tp.backward(out_shard(grad_y))
    scores = {"output": score(y_tp, ref["output"], ref64["output"], out_shard)}
    if x.is_floating_point():
        scores["input grad"] = score(x_tp.grad, ref["input grad"], ref64["input grad"], in_shard)
    return scores | grad_scores(dense, exact, parallel)


def grad_scores(dense: nn.Module, exact: nn.Module, parallel: nn.Module) -> dict:
    """The score of every parameter-gradient shard of ``parallel``."""
    ref, ref64 = dict(dense.named_parameters()), dict(exact.named_parameters())
    scores = {}
    for name, p in parallel.named_parameters():
        scores[f"grad {name}"] = (float("inf"), 0.0) if p.grad is None else score(
            p.grad, ref[name].grad, ref64[name].grad, partial(dense_shard, spec=p.tp_shard))
    return scores


def assert_within(results: list[dict[str, tuple[float, float]]], case: dict,
                  floor: float) -> None:
    """Every rank's every tensor (its ``score``) within its allowed error: ``floor``, or where
    the dense fp32 layer is itself off the fp64 one by more than floor / 4, four times that
    (never above WIDEST); a floor of 0 allows none (bit for bit). Hypothesis found such
    gradients: near-uniform attention in heads of width 1-2 (scores that nearly tie) leaves
    q_proj's gradient 3e-5 off in the dense fp32 layer, and the parallel one rounds as much (the
    largest measured: 5.0e-7 where the dense layer was 3.8e-6 off, a norm weight's gradient in
    test_parallel_block). A sharding bug is off by O(1)."""
    for r, scores in enumerate(results):
        for name, (e, own) in scores.items():
            allowed = min(max(floor, 4 * own), WIDEST) if floor else 0.0
            assert e <= allowed, f"{name} on rank {r}: {e:.3e} > {allowed:.1e}; {case}"


def seq(sp: bool):
    """The rank's piece of a (B, T, ...) activation: its sequence shard under SP."""
    return (lambda t: shard(t, 1)) if sp else (lambda t: t)


@st.composite
def shapes(draw) -> dict:
    """TP size, batch, sequence length and SP flag. Under SP any length of at least one token
    per rank, its shards uneven where it does not divide (shorter ones are refused: see
    test_short_sequence_refused)."""
    n = draw(st.sampled_from(TP_SIZES))
    sp = draw(st.booleans())
    t = draw(st.integers(n if sp else 1, 12))
    return {"n": n, "sp": sp, "b": draw(st.integers(1, 3)), "t": t,
            "seed": draw(st.integers(0, 2**16))}


def width(n: int):
    """A feature count that splits over n ranks, often unevenly."""
    return st.integers(n, 20)


# -- column and row linear ---------------------------------------------------------------------


@st.composite
def column_cases(draw) -> dict:
    c = draw(shapes())
    return c | {"in": draw(width(1)), "out": draw(width(c["n"])), "bias": draw(st.booleans()),
                "gather": draw(st.booleans()), "keep": c["sp"] and draw(st.booleans())}


def _column_body(c):
    torch.manual_seed(c["seed"])
    dense = nn.Linear(c["in"], c["out"], c["bias"])
    layer = ColumnParallelLinear.from_dense(dense, c["gather"], c["sp"],
                                            keep_gathered_input=c["keep"])
    out = (lambda t: t) if c["gather"] else (lambda t: shard(t, -1))
    return compare(dense, layer, torch.randn(c["b"], c["t"], c["in"]), seq(c["sp"]), out)


@settings(max_examples=60, **PROPERTY)
@given(c=column_cases())
def test_column_parallel_linear(ranks, c):
    """Output gathered or left sharded by features, SP input shards or not: the dense linear."""
    assert_within(ranks(c["n"]).run(_column_body, c), c, FLOOR["column"])


@st.composite
def row_cases(draw) -> dict:
    c = draw(shapes())
    return c | {"in": draw(width(c["n"])), "out": draw(width(1)), "bias": draw(st.booleans()),
                "parallel_in": draw(st.booleans()), "fused": draw(st.booleans())}


def _row_body(c):
    torch.manual_seed(c["seed"])
    dense = nn.Linear(c["in"], c["out"], c["bias"])
    layer = RowParallelLinear.from_dense(dense, c["parallel_in"], c["sp"], fused=c["fused"])
    inp = (lambda t: shard(t, -1)) if c["parallel_in"] else (lambda t: t)
    return compare(dense, layer, torch.randn(c["b"], c["t"], c["in"]), inp, seq(c["sp"]))


@settings(max_examples=45, **PROPERTY)
@given(c=row_cases())
def test_row_parallel_linear(ranks, c):
    """Input split by features (or split here), output all-reduced or reduce-scattered by
    sequence, the bias added once: the dense linear."""
    assert_within(ranks(c["n"]).run(_row_body, c), c, FLOOR["row"])


# -- vocabulary: embedding and loss ---------------------------------------------------------------


@st.composite
def vocab_cases(draw) -> dict:
    c = draw(shapes())
    v = draw(st.integers(c["n"], 40))
    return c | {"v": v, "d": draw(width(1)), "pad": draw(st.none() | st.integers(0, v - 1)),
                "smoothing": draw(st.sampled_from([0.0, 0.1, 0.3])),
                "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
                "ignore_every": draw(st.integers(2, 6)), "scale": draw(st.sampled_from([1, 5])),
                "vocab_given": draw(st.booleans())}


def _embedding_body(c):
    torch.manual_seed(c["seed"])
    dense = nn.Embedding(c["v"], c["d"], padding_idx=c["pad"])
    layer = VocabParallelEmbedding.from_dense(dense, c["sp"])
    ids = torch.randint(c["v"], (c["b"], c["t"]))
    return compare(dense, layer, ids, out_shard=seq(c["sp"]))


@settings(max_examples=50, **PROPERTY)
@given(c=vocab_cases())
def test_vocab_parallel_embedding(ranks, c):
    """Rows split by vocabulary, a padding row or not, SP output or not: nn.Embedding."""
    assert_within(ranks(c["n"]).run(_embedding_body, c), c, FLOOR["embedding"])


def _cross_entropy_body(c):
    torch.manual_seed(c["seed"])
    logits = torch.randn(c["b"], c["t"], c["v"]) * c["scale"]
    target = torch.randint(c["v"], (c["b"], c["t"]))
    target.view(-1)[1::c["ignore_every"]] = -100  # token 0 stays: "mean" never divides by 0
    kw = {"label_smoothing": c["smoothing"], "reduction": c["reduction"]}
    grad = torch.randn(target.shape if c["reduction"] == "none" else ())
    ref = {}
    for dtype in (torch.float32, torch.float64):  # the dense loss, and its fp64 twin
        dense = leaf(logits.to(dtype))
        loss = F.cross_entropy(dense.flatten(0, 1), target.flatten(), **kw)
        loss.view(target.shape if c["reduction"] == "none" else ()).backward(grad.to(dtype))
        ref[dtype] = loss.detach().view(grad.shape), dense.grad
    local = leaf(shard(logits, -1))
    # the vocabulary given (the target logits travel with the statistics) or sent by the ranks
    given = {"vocab_size": c["v"], "reuse_logits": True} if c["vocab_given"] else {}
    loss = vocab_parallel_cross_entropy(local * 1, target, **kw, **given)
    loss.backward(grad)
    (loss32, grad32), (loss64, grad64) = ref[torch.float32], ref[torch.float64]
    return {"loss": score(loss, loss32, loss64),
            "logits grad": score(local.grad, grad32, grad64, lambda t: shard(t, -1))}


@settings(max_examples=45, **PROPERTY)
@given(c=vocab_cases())
def test_vocab_parallel_cross_entropy(ranks, c):
    """Logits split by vocabulary, ignored tokens, label smoothing, every reduction, the
    vocabulary size given (the logits' buffer reused) or not: the loss and the logits gradient of
    F.cross_entropy on the whole vocabulary."""
    assert_within(ranks(c["n"]).run(_cross_entropy_body, c), c, FLOOR["cross entropy"])


# -- norms -----------------------------------------------------------------------------------------


@st.composite
def norm_cases(draw) -> dict:
    # RMSNorm from width 2: at width 1 its input gradient is r w g eps r^2 (1 - x^2 r^2
    # cancels), rounding alone in fp32: torch's own fp32 layer is 5-170% off fp64 there, and
    # tensorpar's CPU norm (another order of the same operations) differs from it as much
    rms = draw(st.booleans())
    return draw(shapes()) | {"rms": rms, "d": draw(width(2 if rms else 1))}


def _norm_body(c):
    torch.manual_seed(c["seed"])
    # RMSNorm's default eps is its dtype's: name fp32's, so that the fp64 copy the errors are
    # measured against computes the same function
    eps = torch.finfo(torch.float32).eps
    dense = nn.RMSNorm(c["d"], eps=eps) if c["rms"] else nn.LayerNorm(c["d"])
    with torch.no_grad():  # affine parameters away from their initial ones and zeros
        for p in dense.parameters():
            p.uniform_(0.5, 1.5)
    layer = (RMSNorm if c["rms"] else LayerNorm).from_dense(dense, sequence_parallel=c["sp"])
    return compare(dense, layer, torch.randn(c["b"], c["t"], c["d"]), seq(c["sp"]), seq(c["sp"]))


@settings(max_examples=50, **PROPERTY)
@given(c=norm_cases())
def test_norms(ranks, c):
    """RMSNorm and LayerNorm on sequence shards (weight gradients summed) or whole sequences."""
    assert_within(ranks(c["n"]).run(_norm_body, c), c, FLOOR["norms"])


def test_error_metric_sees_a_wrong_shard(ranks):
    """The properties can fail: a shard with a wrong weight is caught."""
    results = ranks(2).run(_wrong_shard_body)
    with pytest.raises(AssertionError, match="on rank"):
        assert_within(results, {}, FLOOR["column"])


def _wrong_shard_body():
    torch.manual_seed(0)
    dense = nn.Linear(6, 8)
    layer = ColumnParallelLinear.from_dense(dense)
    with torch.no_grad():
        layer.weight.add_(1.0)
    return compare(dense, layer, torch.randn(2, 3, 6), out_shard=lambda t: shard(t, -1))
