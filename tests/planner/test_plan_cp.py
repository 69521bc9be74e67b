"""The planner under context parallelism: a CP rank's activations (its tokens' share, the whole
sequence's K and V, its queries' mask against every key) against what the blocks save on real
gloo ranks; the K/V collectives against the layer's own count; the layout search over cp; and
``plan --cp``. Pure arithmetic but for the one measured run (two ranks, a tiny stack: slow
tier)."""

import argparse
import json

import pytest
import torch
import torch.distributed as dist

from tensorpar import ParallelMLP, ParallelSelfAttention, RankPool, RMSNorm
from tensorpar.cli import plan as plan_cli
from tensorpar.gpt.model import GPTConfig
from tensorpar.parallel.context import cp_sizes, split_to_cp
from tensorpar.planner.activations import block_terms
from tensorpar.planner.comm import cp_comm
from tensorpar.planner.search import search_layouts
from tensorpar.planner.shapes import preset
from tensorpar.planner.step import Step
from tensorpar.planner.tp_plan import plan_memory
from tensorpar.runtime.output import GIB
from tensorpar.train.shape import gpt_shape
from tensorpar.transformer.context_parallel import CPSequence, attention_collective_counts
from tensorpar.transformer.rotary import rotary_table

CFG = GPTConfig(n_layer=2, dim=32, n_head=4, n_kv_head=2)  # hidden 96, GQA repeated
T = 30  # uneven: 4 chunks of 8, 8, 7, 7 at cp 2
PACKED = [[7, 11, 12], [30]]  # example lengths of the two rows when packed


def _build(*argv) -> dict:
    ap = argparse.ArgumentParser()
    plan_cli.add_parser(ap.add_subparsers())
    return plan_cli.build(ap.parse_args(["plan", *argv]))


def _saved_bytes(tp_group, cp_group, autocast: bool, packed: bool) -> int:
    """The bytes a 2-block stack of the core's layers saves for backward on this rank (its CP
    chunks of two rows of T tokens; the input requires grad, as the embedding's output does),
    each storage once, the parameters left out."""
    torch.manual_seed(0)
    layers = [(RMSNorm(CFG.dim, group=tp_group),
               ParallelSelfAttention(CFG.dim, CFG.n_head, CFG.n_kv_head, bias=False,
                                     group=tp_group, cp_group=cp_group, fused=True),
               RMSNorm(CFG.dim, group=tp_group),
               ParallelMLP(CFG.dim, CFG.hidden_dim, gated=True, activation="silu", bias=False,
                           group=tp_group, fused=True)) for _ in range(CFG.n_layer)]
    params = {p.untyped_storage().data_ptr() for layer in layers for m in layer
              for p in m.parameters()}
    pos = torch.stack([torch.cat([torch.arange(k) for k in row]) for row in PACKED]) \
        if packed else None
    context = CPSequence(T, pos)
    rope = rotary_table(CFG.head_dim, 0, T, CFG.rope_theta)
    if packed:  # tables per row, from its restarting positions: (B, 1, T, hd/2)
        rope = tuple(t[pos][:, None] for t in rope)
    x = split_to_cp(torch.randn(2, T, CFG.dim), cp_group).requires_grad_()
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        for attn_norm, attn, mlp_norm, mlp in layers:
            x = x + attn(attn_norm(x), rope, context=context)
            x = x + mlp(mlp_norm(x))
    return sum(saved.values())


def _all_saved() -> dict:
    """This rank's saved bytes at cp 2 (TP of one rank), fp32 and bf16 autocast, rows whole or
    packed."""
    tp_group = dist.new_subgroups(1)[0]
    cp_group = dist.new_group(list(range(dist.get_world_size())))
    out = {(ac, packed): _saved_bytes(tp_group, cp_group, ac, packed)
           for ac in (False, True) for packed in (False, True)}
    return out


@pytest.fixture(scope="module")
def measured():
    """Each rank's saved bytes in every case: one run on two ranks of their own (the session's
    pool of two serves tests that measure memory, which a run here left 6% higher: not found
    why yet)."""
    with RankPool(2, backend="gloo", threads=1, timeout_s=240) as pool:
        per_rank = pool.run(_all_saved)
    return {case: [r[case] for r in per_rank] for case in per_rank[0]}


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_block_terms_equal_what_the_blocks_save_at_cp2(measured, autocast, packed):
    """At cp 2 on two rows of 30 tokens (each rank 15 of each), what the blocks save equals
    the planner's block terms times the layers to the byte: the rank's tokens' share, K and V
    of all 30 tokens (repeated per query head), the (T_i, T) mask in the queries' dtype (one
    per row when packed) and each block's rows of the rotary tables."""
    step = Step(gpt_shape(CFG), batch=2, seq=T, dtype="bf16-autocast" if autocast else "fp32",
                cp=2, packed=packed)
    assert cp_sizes(T, 2) == [15, 15]
    planned = CFG.n_layer * block_terms(step)["total"]
    assert measured[autocast, packed] == [planned, planned]


def test_llama3_8b_at_cp8_is_an_eighth_but_for_the_gathered_keys_and_the_mask():
    """Llama-3-8B at TP 8, one sequence of 131,072 tokens, bf16: every per-token activation of
    a rank at cp 8 is 1/8 of cp 1's; what is not is the whole sequence's K and V (repeated per
    query head) and the (16,384 x 131,072) bf16 mask of each layer, 4 GiB a layer, which with
    this all-gather layer is most of it (0.45 of cp 1's activations; 0.142 without it)."""
    shape = preset("llama-3-8b")
    one = Step(shape, tp=8, seq=131072, dtype="bf16")
    r1, r8 = plan_memory(one), plan_memory(one.replace(cp=8))
    a = block_terms(one.replace(dtype="bf16-autocast"))
    b = block_terms(one.replace(dtype="bf16-autocast", cp=8))
    assert b["attention mask"] == 16384 * 131072 * 2 == 4 * GIB
    assert b["sdpa q, k, v"] - b["sdpa output"] == a["sdpa q, k, v"] - a["sdpa output"]
    excess = shape.n_layer * (b["attention mask"] + b["sdpa q, k, v"] - a["sdpa q, k, v"] / 8)
    assert (r8["activations"] - excess) == pytest.approx(r1["activations"] / 8, rel=1e-6)
    assert r8["activations"] / r1["activations"] == pytest.approx(0.4535, abs=1e-3)
    without_mask = r8["activations"] - shape.n_layer * b["attention mask"]
    assert without_mask / r1["activations"] == pytest.approx(0.142, abs=1e-3)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cp_comm_counts_the_layers_collectives(recompute):
    """Per layer and pass, the layer's own count (``attention_collective_counts``): an
    all-gather forward (again when recomputed) and a reduce-scatter backward, each of the whole
    sequence's stacked K and V of the rank's KV heads, the uneven chunks padded to the largest
    (30 tokens over cp 4: 7, 7, 8, 8, so 4 x 8 rows); ring bytes 3/4 of the payload."""
    step = Step(gpt_shape(CFG), tp=2, seq=T, dtype="bf16-autocast", cp=4, batch=6,
                micro_batches=3, recompute=recompute)
    c = cp_comm(step.shape, step.micro, T, 2, 4, step.dtype, recompute, step.micro_batches)
    layer = attention_collective_counts(2, 4)
    passes = CFG.n_layer * 3
    forward = 2 if recompute == "full" else 1
    assert c["counts"] == {"all_gather": forward * passes * layer["forward"]["all_gather"],
                           "reduce_scatter": passes * layer["backward"]["reduce_scatter"]}
    payload = 2 * 2 * 1 * 4 * 8 * CFG.head_dim * 2  # K and V, B=2, 1 KV head at TP 2, bf16
    assert c["bytes"]["reduce_scatter"] == passes * payload
    assert c["ring_bytes"]["all_gather"] == forward * passes * payload * 3 // 4
    assert cp_comm(step.shape, step.micro, T, 2, 1, step.dtype)["counts"] == {}


def test_search_tries_cp_only_when_no_layout_fits_without():
    """Llama-3-8B on 64 devices of 80 GB at 131,072 tokens (bf16, recomputed): no layout fits
    at cp 1, and the search lists layouts with cp > 1 (and only those); a sequence that fits
    without CP is searched at cp 1 alone; a --cp restricts the search to it."""
    step = Step(preset("llama-3-8b"), seq=131072, dtype="bf16", recompute="full", batch=64)
    out = search_layouts(step, 64, 80e9)
    assert out["layouts"] and all(r["cp"] > 1 for r in out["layouts"])
    assert any(r["cp"] == 1 for r in out["layouts"] + out["skipped"]) or out["planned"]
    short = search_layouts(step.replace(seq=4096), 64, 80e9)
    assert short["layouts"] and {r["cp"] for r in short["layouts"]} == {1}
    only = search_layouts(step, 64, 80e9, tps=[8], cps=[4])
    assert {(r["tp"], r["cp"]) for r in only["layouts"]} == {(8, 4)}


def test_plan_cp_rows_json_and_refusal():
    """``plan --cp 2``: each row planned at cp 2, the K/V collectives beside the TP ones; the
    FSDP2 shards over dp x cp; a sequence too short for 2 chunks a rank refused in one line."""
    out = _build("--model", "gpt2", "--tp", "1,2", "--cp", "2", "--seq-len", "1024", "--json")
    assert [r["cp"] for r in out["rows"]] == [2, 2] and out["cp"] == 2
    assert set(out["cp_comm"]) == {"1", "2"}
    assert out["cp_comm"]["2"]["counts"] == {"all_gather": 12, "reduce_scatter": 12}
    assert json.dumps(out)
    with pytest.raises(ValueError, match=r"^--tp 1 for gpt2: --cp: a sequence of 6 tokens "
                                         r"cannot be cut into 8 chunks"):
        _build("--model", "gpt2", "--tp", "1", "--cp", "4", "--seq-len", "6")
