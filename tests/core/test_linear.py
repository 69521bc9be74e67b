"""Column- and row-parallel linear layers against nn.Linear: outputs, input and weight grads."""

import pytest
import torch
from torch import nn

from tensorpar import ColumnParallelLinear, RowParallelLinear
from tensorpar.runtime.groups import tp_size

from tests_common import WORLD_SIZES
from tp_check import compare_module, counts_ok, shard

B, T, IN, OUT = 2, 13, 10, 14  # 10, 14 and (under SP) 13 split unevenly over 2, 3 or 4 ranks
# the largest relative error of the output and every gradient, ~10x the largest measured over
# TP=1-4 and each test's cases (2026-11-27, torch 2.13 CPU)
COLUMN_TOL = 2.5e-6  # measured 2.3e-7 (the bias gradient, TP=4)
ROW_TOL = 1.5e-6  # measured 1.5e-7 (the weight gradient, TP=4)


def _column_body(bias, gather_output, sequence_parallel, keep_gathered_input=False):
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias)
    layer = ColumnParallelLinear.from_dense(dense, gather_output, sequence_parallel,
                                            keep_gathered_input=keep_gathered_input)
    x = torch.randn(B, T, IN)
    return compare_module(
        dense, layer, x,
        in_shard=(lambda t: shard(t, 1)) if sequence_parallel else (lambda t: t),
        out_shard=(lambda t: t) if gather_output else (lambda t: shard(t, -1)),
        tol=COLUMN_TOL,
    )


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("bias,gather_output,sp,keep", [
    (True, False, False, False), (False, True, False, False), (True, False, True, False),
    (True, True, True, False), (True, False, True, True)])
def test_column_parallel(ranks, n, bias, gather_output, sp, keep):
    """Y_i = X W_i^T + b_i on every rank equals the dense output's shard (or the whole output when
    gathered); f costs one all-reduce in backward, or an all-gather/reduce-scatter pair under SP.
    Under SP the layer keeps its input shard and all-gathers it again in backward (one more
    all-gather), unless ``keep_gathered_input`` keeps the gathered input. Called without
    ``seq_len``, the SP layer first exchanges the ranks' shard sizes (one small all-gather)."""
    results = ranks(n).run(_column_body, bias, gather_output, sp, keep)
    if n == 1:
        return counts_ok(results, {}, {})
    fwd = {"all_gather": 2 + gather_output} if sp else ({"all_gather": 1} if gather_output else {})
    bwd = ({"reduce_scatter": 1} | ({} if keep else {"all_gather": 1})) if sp else \
        {"all_reduce": 1}
    counts_ok(results, fwd, bwd)


def _row_body(bias, input_is_parallel, sequence_parallel):
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias)
    layer = RowParallelLinear.from_dense(dense, input_is_parallel, sequence_parallel)
    x = torch.randn(B, T, IN)
    return compare_module(
        dense, layer, x,
        in_shard=(lambda t: shard(t, -1)) if input_is_parallel else (lambda t: t),
        out_shard=(lambda t: shard(t, 1)) if sequence_parallel else (lambda t: t),
        tol=ROW_TOL,
    )


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("bias,input_is_parallel,sp", [
    (True, True, False), (False, False, False), (True, True, True), (True, False, True)])
def test_row_parallel(ranks, n, bias, input_is_parallel, sp):
    """sum_i X_i W_i^T + b equals the dense output; one all-reduce forward (reduce-scatter under
    SP), the bias added once; under SP the bias gradient is summed with one more all-reduce."""
    results = ranks(n).run(_row_body, bias, input_is_parallel, sp)
    if n == 1:
        return counts_ok(results, {}, {})
    fwd = {"reduce_scatter": 1} if sp else {"all_reduce": 1}
    bwd = {"all_gather": 1 + (not input_is_parallel)} if sp else (
        {} if input_is_parallel else {"all_gather": 1})
    if sp and bias:
        bwd["all_reduce"] = 1
    counts_ok(results, fwd, bwd)


def _init_body():
    for seed in (0, 1):
        torch.manual_seed(seed)
        col = ColumnParallelLinear(IN, OUT)
        row = RowParallelLinear(OUT, IN)
        torch.manual_seed(seed)
        dense_col, dense_row = nn.Linear(IN, OUT), nn.Linear(OUT, IN)
        assert torch.equal(col.weight, shard(dense_col.weight, 0))
        assert torch.equal(col.bias, shard(dense_col.bias, 0))
        assert torch.equal(row.weight, shard(dense_row.weight, 1))
        assert torch.equal(row.bias, dense_row.bias)
    return True


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_init_is_the_same_at_every_tp_size(ranks, n):
    """Built from scratch after manual_seed(s), each rank holds its shard of nn.Linear(seed s)."""
    assert all(ranks(n).run(_init_body))


def _frozen_body():
    from tensorpar import LayerNorm, VocabParallelEmbedding

    dense = nn.Linear(IN, OUT)
    dense.bias.requires_grad_(False)
    col, row = ColumnParallelLinear.from_dense(dense), RowParallelLinear.from_dense(dense)
    norm = nn.LayerNorm(IN)
    norm.weight.requires_grad_(False)
    emb = nn.Embedding(IN, 4).requires_grad_(False)
    assert col.weight.requires_grad and row.weight.requires_grad
    assert not col.bias.requires_grad and not row.bias.requires_grad
    tp_norm = LayerNorm.from_dense(norm)
    assert not tp_norm.weight.requires_grad and tp_norm.bias.requires_grad
    assert not VocabParallelEmbedding.from_dense(emb).weight.requires_grad
    return True


@pytest.mark.parametrize("n", [1, 2])
def test_from_dense_keeps_frozen_parameters_frozen(ranks, n):
    """A dense parameter with requires_grad=False gives a shard with requires_grad=False."""
    assert all(ranks(n).run(_frozen_body))


def _bad_input_body():
    torch.manual_seed(0)
    col = ColumnParallelLinear(IN, OUT)
    row = RowParallelLinear(IN, OUT)
    local = row.in_features_local
    with pytest.raises(ValueError, match=f"last dim 7, expected {IN}"):
        col(torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match=f"last dim {IN}, expected {local}"):
        row(torch.randn(2, 3, IN))  # the full input where this rank's shard is due
    with pytest.raises(ValueError, match=f"out_features=2 cannot be split over {tp_size()}"):
        ColumnParallelLinear(IN, 2)
    return True


@pytest.mark.parametrize("n", [3, 4])
def test_bad_input_is_refused_on_every_rank(ranks, n):
    """Mismatched shapes and unsplittable sizes raise ValueError with the numbers, on every rank."""
    assert all(ranks(n).run(_bad_input_body))
