"""The parallel MLP and attention against dense references: outputs, grads, collective counts."""

import pytest
import torch
import torch.nn.functional as F

from tensorpar import ParallelMLP, ParallelSelfAttention
from tensorpar.runtime.groups import tp_size
from tensorpar.transformer.attention import head_shards
from tensorpar.transformer.reference import DenseAttention, DenseMLP

from tests_common import WORLD_SIZES
from tp_check import compare_module, counts_ok, shard

B, T, D = 2, 13, 24  # 13 tokens: uneven sequence shards over 2, 3 and 4 ranks under SP
# the largest relative error of the output and every gradient, ~10x the largest measured over
# TP=1-4 and every test's cases (2026-11-27, torch 2.13 CPU)
MLP_TOL = 3e-6  # measured 3.3e-7 (the output, gated, SP, TP=2)
ATTENTION_TOL = 1e-5  # measured 9.2e-7 (q_proj's gradient, a K bias only, TP=4)
# under SP, a block called without seq_len=T first exchanges the ranks' shard sizes: one small
# all-gather more in forward (the GPT passes T and has none)
FWD_SP = {"all_gather": 2, "reduce_scatter": 1}


def _sp_shards(sp):
    return (lambda t: shard(t, 1)) if sp else (lambda t: t)


def _mlp_body(gated, bias, sp, fused=False, keep=False):
    torch.manual_seed(0)
    act = F.silu if gated else F.gelu
    dense = DenseMLP(D, 50, gated=gated, bias=bias, activation=act)  # 50: uneven over 3 and 4
    mlp = ParallelMLP.from_dense(dense.up, dense.down, dense.gate,
                                 activation="silu" if gated else "gelu", sequence_parallel=sp,
                                 fused=fused, keep_gathered_input=keep)
    return compare_module(dense, mlp, torch.randn(B, T, D), _sp_shards(sp), _sp_shards(sp),
                          tol=MLP_TOL)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("gated,bias,sp", [(False, True, False), (True, False, False),
                                           (True, False, True), (False, True, True)])
@pytest.mark.parametrize("fused", [False, True])
def test_parallel_mlp(ranks, n, gated, bias, sp, fused):
    """Column then row: the activation runs on hidden shards with no sync, so the MLP costs
    exactly one all-reduce forward and one backward (one all-gather + one reduce-scatter each way
    under SP, plus the all-reduce of the replicated down-bias gradient when there is a bias).
    Fused (gate and up as one autograd op, the backward collective overlapped): the same numbers and
    the same collectives. Under SP gate and up keep their input shard and all-gather it again in
    backward: a second all-gather there."""
    results = ranks(n).run(_mlp_body, gated, bias, sp, fused)
    if n == 1:
        return counts_ok(results, {}, {})
    if not sp:
        return counts_ok(results, {"all_reduce": 1}, {"all_reduce": 1})
    bwd = {"all_gather": 2, "reduce_scatter": 1} | ({"all_reduce": 1} if bias else {})
    counts_ok(results, FWD_SP, bwd)


def _attention_body(heads, kv_heads, sp, causal, bias=False, fused=False, keep=False):
    """bias: True (all four projections), False, or a string naming the ones that have one."""
    torch.manual_seed(0)
    dense = DenseAttention(D, heads, kv_heads, head_dim=4, bias=bias is True, causal=causal)
    if isinstance(bias, str):  # e.g. "v": only the V projection has a bias
        for name in bias:
            proj = getattr(dense, f"{name}_proj")
            proj.bias = torch.nn.Parameter(torch.randn(proj.out_features))
    attn = ParallelSelfAttention.from_dense(dense.q_proj, dense.k_proj, dense.v_proj,
                                            dense.o_proj, heads, kv_heads, causal=causal,
                                            sequence_parallel=sp, fused=fused,
                                            keep_gathered_input=keep)
    return compare_module(dense, attn, torch.randn(B, T, D), _sp_shards(sp), _sp_shards(sp),
                          zero_grads=("k_proj.bias",), tol=ATTENTION_TOL)


ATTENTION_LAYOUTS = [  # (heads, kv_heads): MHA, GQA, MQA, uneven heads
    (8, 8), (8, 2), (8, 1), (6, 3), (12, 4), (5, 5)]


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("heads,kv_heads", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_parallel_attention(ranks, n, heads, kv_heads, sp, fused):
    """Heads split across ranks (tensor_split over heads); KV heads shared by several ranks when
    there are fewer than ranks, their gradients summed with one all-reduce in backward. Fused
    QKV (one autograd op, the backward collective overlapped): the same numbers and collectives.
    Under SP, Q, K and V keep their input shard: one more all-gather in backward."""
    if heads < n:
        pytest.skip("fewer heads than ranks is refused: see test_attention_errors")
    results = ranks(n).run(_attention_body, heads, kv_heads, sp, True, False, fused)
    if n == 1:
        return counts_ok(results, {}, {})
    shared = head_shards(heads, kv_heads, n, 0)[2]
    fwd = FWD_SP if sp else {"all_reduce": 1}
    bwd = {"all_gather": 2, "reduce_scatter": 1} if sp else {"all_reduce": 1}
    if shared:
        bwd["all_reduce"] = bwd.get("all_reduce", 0) + 1
    counts_ok(results, fwd, bwd)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("bias", ["v", "k", "qo"])
@pytest.mark.parametrize("fused", [False, True])
def test_parallel_attention_partial_biases(ranks, n, bias, fused):
    """Any subset of the projections may carry a bias (K without V, V without K, ...)."""
    ranks(n).run(_attention_body, 8, 2, False, True, bias, fused)


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_attention_not_causal(ranks, n):
    """Bidirectional attention (causal=False) matches too."""
    ranks(n).run(_attention_body, 8, 2, False, False)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_parallel_attention_with_biases(ranks, n, sp, fused):
    """Q/K/V/O biases (Qwen-style): the shared-KV gradient sum covers the KV biases, and under SP
    the replicated output bias gradient is summed too (one all-reduce for all of them each)."""
    results = ranks(n).run(_attention_body, 8, 2, sp, True, True, fused)
    if n == 1:
        return counts_ok(results, {}, {})
    fwd = FWD_SP if sp else {"all_reduce": 1}
    bwd = ({"all_gather": 2, "reduce_scatter": 1} if sp else {"all_reduce": 1})
    bwd["all_reduce"] = bwd.get("all_reduce", 0) + head_shards(8, 2, n, 0)[2] + sp
    counts_ok(results, fwd, bwd)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_keep_gathered_input(ranks, n, fused):
    """keep_gathered_input=True under SP: the column side keeps the gathered input instead of
    its shard, so the backward has no second all-gather; the numbers are the same (MLP with
    uneven hidden shards, GQA attention with shared KV heads at 3 and 4 ranks)."""
    mlp = ranks(n).run(_mlp_body, True, False, True, fused, True)
    attn = ranks(n).run(_attention_body, 8, 2, True, True, False, fused, True)
    if n == 1:
        return counts_ok(mlp + attn, {}, {})
    counts_ok(mlp, FWD_SP, {"all_gather": 1, "reduce_scatter": 1})
    counts_ok(attn, FWD_SP,
              {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1})


def test_head_shards_shares_kv_heads_only_when_needed():
    """MQA over 4 ranks: every rank holds KV head 0; GQA 8/4 over 2 ranks: a clean split."""
    assert [head_shards(8, 1, 4, r)[1] for r in range(4)] == [(0, 1)] * 4
    assert head_shards(8, 1, 4, 0)[2] is True
    assert [head_shards(8, 4, 2, r)[:2] for r in range(2)] == [((0, 4), (0, 2)), ((4, 8), (2, 4))]
    assert head_shards(8, 4, 2, 0)[2] is False
    assert [head_shards(8, 4, 3, r)[1] for r in range(3)] == [(0, 2), (1, 3), (3, 4)]


def _attention_errors_body():
    n = tp_size()
    lin = torch.nn.Linear
    with pytest.raises(ValueError, match=f"num_heads=2 cannot be split over {n} ranks"):
        ParallelSelfAttention(D, 2)
    with pytest.raises(ValueError, match="num_heads=8 must be a positive multiple of "
                                         "num_kv_heads=3"):
        ParallelSelfAttention(D, 8, 3, head_dim=4)
    with pytest.raises(ValueError, match="dim=24 does not divide by num_heads=5"):
        ParallelSelfAttention(D, 5)
    with pytest.raises(ValueError, match="k projection is 24<->12, expected 24<->8"):
        ParallelSelfAttention.from_dense(lin(D, 32), lin(D, 12), lin(D, 8), lin(32, D), 8, 2)
    attn = ParallelSelfAttention(D, 8, 2)
    with pytest.raises(ValueError, match="expected input \\(B, T, 24\\), got \\(2, 5, 16\\)"):
        attn(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="num_heads=0 must be a positive multiple"):
        ParallelSelfAttention.from_dense(lin(D, 32), lin(D, 8), lin(D, 8), lin(32, D), 0)
    with pytest.raises(ValueError, match="activation='swish'"):
        ParallelMLP(D, 40, activation="swish")
    return True


@pytest.mark.parametrize("n", [3, 4])
def test_attention_errors(ranks, n):
    """Head counts that cannot be split and mismatched projections raise ValueError with the
    numbers, on every rank."""
    assert all(ranks(n).run(_attention_errors_body))
