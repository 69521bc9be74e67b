"""The pipeline planner (``planner/pipeline.py``) by its invariants, without processes: the bubble
formulas, torch's schedule order replayed, the point-to-point counts and bytes, the stages' memory
adding up to the whole model's (and P = 1 being ``plan_memory``'s row), the first rank's
micro-batches in flight, the search on llama-2-70b, and ``tensorpar plan --pp`` / ``--devices``."""

import argparse
import dataclasses
import json

import pytest
import torch

from tensorpar.cli import plan as plan_cli
from tensorpar.parallel.stages import stage_blocks
from tensorpar.planner.memory import rank_params
from tensorpar.planner.pipeline import (
    micro_batch_pieces,
    p2p,
    plan_pipeline,
    rank_memory,
)
from tensorpar.planner.schedule import bubble, schedule_ops
from tensorpar.planner.search import search_layouts
from tensorpar.planner.shapes import preset
from tensorpar.planner.step import Step
from tensorpar.planner.tp_plan import plan_memory, step_memory

LLAMA7, LLAMA70 = preset("llama-2-7b"), preset("llama-2-70b")


def _pipe(shape, tp, pp, batch, seq, m, virtual=1, dtype="bf16", **kw) -> Step:
    """The step of a (tp, pp) layout: ``batch`` sequences in ``m`` micro-batches."""
    return Step(shape, tp, batch, seq, dtype, pp=pp, virtual=virtual, micro_batches=m, **kw)


def _plan(*argv) -> int:
    ap = argparse.ArgumentParser()
    plan_cli.add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", *argv])
    return args.func(args)


def _max_in_flight(ops: list[tuple[str, int]], virtual: int) -> int:
    """The most stage micro-batches a rank holds at once (forwards run, backwards not yet)."""
    held = most = 0
    for op, _ in ops:
        held += 1 if op == "F" else -1
        most = max(most, held)
    return most


def test_bubble_formulas():
    """(P - 1)/m under 1F1B, (P - 1)/(V·m) interleaved (Narayanan et al. 2021): at P=4, m=8,
    3/8 and, with V=2, 3/16; the layout reports the same."""
    assert bubble(4, 1, 8) == 3 / 8
    assert bubble(4, 2, 8) == 3 / 16
    assert bubble(1, 1, 8) == 0
    for v in (1, 2):
        assert plan_pipeline(_pipe(LLAMA7, 2, 4, 8, 256, 8, v))["bubble"] == 3 / (v * 8)


def test_stages_cut_like_tensor_split():
    """A stage's blocks are consecutive, sized as torch.tensor_split cuts n_layer (the larger
    first), and cover every block once."""
    for n, stages in ((80, 8), (32, 6), (10, 4), (7, 7)):
        cut = stage_blocks(n, stages)
        sizes = [len(t) for t in torch.tensor_split(torch.arange(n), stages)]
        assert [len(r) for r in cut] == sizes
        assert [i for r in cut for i in r] == list(range(n))


@pytest.mark.parametrize("pp,virtual,m", [(2, 2, 4), (4, 2, 8), (4, 2, 12), (4, 3, 6),
                                          (3, 2, 3), (4, 4, 16)])
def test_interleaved_order_is_torchs(pp, virtual, m):
    """``schedule_ops`` replays torch 2.13's ScheduleInterleaved1F1B rank by rank: the same
    forwards and backwards of the same local stages in the same order (torch's own plan,
    computed without processes)."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    s = sched.ScheduleInterleaved1F1B.__new__(sched.ScheduleInterleaved1F1B)
    s.n_local_stages, s.pp_group_size, s._n_microbatches = virtual, pp, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    kinds = {sched._ComputationType.FORWARD: "F", sched._ComputationType.FULL_BACKWARD: "B"}
    for rank in range(pp):
        theirs = [(kinds[a.computation_type], a.stage_index // pp)
                  for a in s._calculate_single_rank_operations(rank) if a is not None]
        assert schedule_ops(pp, virtual, m, rank) == theirs


def test_first_rank_holds_p_micro_batches():
    """1F1B: rank k holds min(m, P - k) micro-batches at its peak (P on the first); interleaved
    with P | m the first holds P·V + P - 1 stage micro-batches of L/(P·V) blocks (Korthikanti et
    al. 2022, 4.2.3), in torch's order replayed and in the planner's row."""
    P, m = 4, 8
    for k in range(P):
        assert _max_in_flight(schedule_ops(P, 1, m, k), 1) == P - k
        row = rank_memory(_pipe(LLAMA7, 2, P, m, 256, m), k)
        assert row["in_flight"] == [P - k]
    assert _max_in_flight(schedule_ops(P, 1, 2, 0), 1) == 2  # fewer micro-batches than P
    for v in (2, 4):
        chunks = _max_in_flight(schedule_ops(P, v, m, 0), v)
        assert chunks == P * v + P - 1  # (P·(1 + (P - 1)/(P·V)) micro-batches of L/P blocks)
        assert sum(rank_memory(_pipe(LLAMA7, 2, P, m, 256, m, v), 0)["in_flight"]) == chunks


def test_p2p_counts_and_bytes():
    """Each boundary carries an activation and a gradient per micro-batch: 2·m·(S-1) sends a
    step; rank k sends m·(V - [k = P-1]) activations and m·(V - [k = 0]) gradients, each
    (micro, T, D) fp32, T/tp tokens (the largest shard) under SP."""
    P, m, micro, T, D = 4, 8, 2, 100, 64
    for v in (1, 2):
        sends = [p2p(P, v, m, k, micro, T, D, 2, False) for k in range(P)]
        assert sum(s["activations"] + s["gradients"] for s in sends) == 2 * m * (P * v - 1)
        for k, s in enumerate(sends):
            assert (s["activations"], s["gradients"]) == (m * (v - (k == P - 1)),
                                                          m * (v - (k == 0)))
            assert s["bytes"] == (s["activations"] + s["gradients"]) * micro * T * D * 4
    assert p2p(P, 1, m, 1, micro, T, D, 3, True)["bytes_each"] == micro * 34 * D * 4
    assert p2p(1, 1, m, 0, micro, T, D, 1, False)["bytes"] == 0
    plan = plan_pipeline(_pipe(LLAMA7, 2, 4, 8, 256, 8, 2))
    assert plan["p2p"]["sends"] == 2 * 8 * 7
    assert [c["pp"] for c in plan["comm"]] == [s["bytes"] for s in plan["p2p"]["per_rank"]]


@pytest.mark.parametrize("dtype,dp,mode,v", [("bf16", 1, "fsdp", 1), ("fp32", 2, "fsdp", 2),
                                             ("bf16-autocast", 2, "ddp", 1)])
def test_stages_add_up_to_the_model(dtype, dp, mode, v):
    """The pipeline ranks' parameters, weights and AdamW states add up to the whole model's at
    the same TP size (and FSDP2 share): the embedding on the first, the norm and head on the
    last, nothing twice; a middle rank holds its blocks alone."""
    P, tp = 4, 2
    plan = plan_pipeline(_pipe(LLAMA7, tp, P, 8 * dp, 128, 8, v, dtype, dp=dp, dp_mode=mode))
    whole = plan_memory(Step(LLAMA7, tp, dp, 128, dtype, dp=dp, dp_mode=mode))
    stages = plan["stages"]
    assert sum(r["params_per_rank"] for r in stages) == rank_params(LLAMA7, tp)["total"]
    assert sum(r["weights"] for r in stages) == whole["weights"]
    assert sum(r["grads"] for r in stages) == whole["grads"]
    assert sum(r["optimizer"] for r in stages) == whole["optimizer"]
    if v == 1:
        block = rank_params(LLAMA7, tp)["block"]
        assert stages[1]["params_per_rank"] == stages[1]["layers"] * block


def test_micro_batch_pieces_make_the_model():
    """The pieces the stages are built from make the one-model planner's activations again:
    the embedding's, L blocks', the tail's and the rotary tables add up to
    ``step_memory``'s for the whole model, in each precision, with SP and recomputation."""
    for dtype, sp, rec in (("bf16", False, "none"), ("fp32", True, "full"),
                           ("bf16-autocast", True, "none")):
        step = Step(LLAMA7, 2, 2, 128, dtype, sp, rec)
        pieces = micro_batch_pieces(step)
        whole = step_memory(step)
        L = LLAMA7.n_layer
        assert (pieces["embedding"] + L * pieces["block"] + pieces["tail"] + pieces["rope"]
                == whole.activations)
        assert min(pieces.values()) >= 0


@pytest.mark.parametrize("dtype,sp,dp,mode", [("bf16", False, 1, "fsdp"),
                                              ("fp32", True, 2, "fsdp"),
                                              ("bf16-autocast", False, 2, "ddp")])
def test_pp1_is_the_planners_row(dtype, sp, dp, mode):
    """Without a pipeline and with one micro-batch the rank's row is ``plan_memory``'s
    exactly; with two micro-batches (accumulation) it stores the same weights and states, and
    its peak holds the whole gradients besides a micro-batch's activations."""
    step = Step(LLAMA7, 2, 4 * dp, 128, dtype, sp, dp=dp, dp_mode=mode)
    plan = plan_pipeline(step)
    row = plan_memory(step)
    mine = plan["stages"][0]
    for key in ("weights", "grads", "optimizer", "activations", "dp_buffers", "peak_bytes",
                "peak_at", "total"):
        assert mine[key] == row[key], key
    assert plan["bubble"] == 0 and plan["p2p"]["sends"] == 0
    two = plan_pipeline(step.replace(micro_batches=2))["stages"][0]
    assert (two["weights"], two["optimizer"]) == (row["weights"], row["optimizer"])
    assert two["peak_bytes"] >= two["grads"] + two["activations"] and two["in_flight"] == [1]


def test_search_finds_layouts_for_llama_2_70b_on_64_x_80gb():
    """On 64 devices of 80 GB every layout listed fits (its largest rank's peak within the
    usable memory), uses all 64 devices with tp <= 8 dividing the heads, and the list is
    ranked by the estimated step time."""
    out = search_layouts(Step(LLAMA70, batch=64, seq=2048), 64, 80e9)
    assert out["layouts"] and out["smallest"] is None
    for r in out["layouts"]:
        assert r["tp"] * r["pp"] * r["dp"] == 64 and r["tp"] <= 8 and 64 % r["tp"] == 0
        assert r["fits"] and r["total"] <= out["usable"]
        assert r["micro_batches"] * r["micro_batch"] * r["dp"] == 64
        assert r["bubble"] == (r["pp"] - 1) / r["micro_batches"]
    seconds = [r["step_seconds"] for r in out["layouts"]]
    assert seconds == sorted(seconds)
    assert any(r["pp"] > 1 for r in out["layouts"])


def test_search_says_nothing_fits_llama_2_70b_on_8_x_24gb(capsys):
    """On 8 devices of 24 GB nothing fits: the command says so in one line with the smallest
    peak any layout has and the device memory it would need, and exits 0 (an answer)."""
    out = search_layouts(Step(LLAMA70, batch=8, seq=2048), 8, 24e9)
    assert out["layouts"] == [] and out["smallest"]["total"] > out["usable"]
    assert _plan("--model", "llama-2-70b", "--devices", "8", "--device-memory", "24GB") == 0
    text = " ".join(capsys.readouterr().out.split())  # as one line, unwrapped
    assert "no layout of 8 devices fits 24GB (20.1 GiB usable): the smallest peak is " in text
    need = out["smallest"]["total"] / 0.9 / 2**30
    assert f"which needs devices of {need:.1f} GiB" in text


def test_cli_json_pipeline_layout(capsys):
    """``tensorpar plan --model M --tp 2 --pp 4 --micro-batches 8 [--pp-virtual 2] --json``: a
    row per pipeline rank, the bubble, the point-to-point sends; 1F1B's first rank holds 4
    micro-batches, the last one."""
    for v in (1, 2):
        assert _plan("--model", "llama-2-70b", "--tp", "2", "--pp", "4", "--micro-batches", "8",
                     "--pp-virtual", str(v), "--json") == 0
        data = json.loads(capsys.readouterr().out)
        assert (data["plan"], data["tp"], data["pp"], data["virtual"]) == ("pipeline", 2, 4, v)
        assert (data["micro_batches"], data["micro_batch"], data["batch"]) == (8, 1, 8)
        assert data["bubble"] == 3 / (v * 8)
        assert data["p2p"]["sends"] == 2 * 8 * (4 * v - 1)
        assert [r["stage"] for r in data["stages"]] == [0, 1, 2, 3]
        assert sum(r["layers"] for r in data["stages"]) == 80
        if v == 1:
            assert [r["in_flight"] for r in data["stages"]] == [[4], [3], [2], [1]]
        worst = max(data["stages"], key=lambda r: r["total"])
        assert data["total"] == worst["total"] and data["fits"] == (worst["total"]
                                                                     <= data["usable"])


def test_cli_json_search(capsys):
    """``--devices 64 --json``: the fitting layouts, best first, and the verdict line."""
    assert _plan("--model", "llama-2-70b", "--devices", "64", "--device-memory", "80GB",
                 "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"] == "search" and data["layouts"] and data["batch"] == 64
    assert data["verdict"].startswith(f"{len(data['layouts'])} of {data['planned']} layouts fit")


@pytest.mark.parametrize("flags,message", [
    (["--pp-virtual", "2"], "--pp-virtual 2 interleaves pipeline stages: give --pp"),
    (["--pp", "4", "--micro-batches", "2"], "--pp 4 needs at least 4 micro-batches"),
    (["--pp", "8", "--pp-virtual", "5", "--micro-batches", "8"],
     "--n-layer 32 cannot be cut into 40 pipeline stages (--pp 8 x --pp-virtual 5)"),
    (["--pp", "4", "--pp-virtual", "2", "--micro-batches", "9"],
     "the interleaved schedule runs the 9 micro-batches in 2 rounds"),
    (["--pp", "2", "--batch", "8", "--micro-batches", "3"],
     "--micro-batches 3 does not divide the 8 sequences of each data-parallel copy"),
    (["--pp", "2", "--tp", "1,2"], "--pp plans one layout; give one TP size"),
    (["--pp", "2", "--png", "x.png"], "--png goes with the TP rows, not with --pp"),
    (["--devices", "8", "--dp", "2"], "--devices searches the data-parallel size itself"),
])
def test_pipeline_mistakes_are_one_line(capsys, flags, message):
    """Each refused pipeline or search names its flags and numbers, in one line, exit 2."""
    assert _plan("--model", "llama-2-7b", *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorpar plan: ") and err.count("\n") == 1 and message in err, err


def test_tied_embeddings_pipeline():
    """A head tied to its embedding under a pipeline: the last stage holds a copy of the table
    in place of an untied head (the same weights, gradients and AdamW states), and the first
    and last ranks each all-reduce its gradient once a step (bf16: 2 bytes an element); the
    search plans pipelines for it."""
    tied = preset("gpt2")
    untied = dataclasses.replace(tied, tie_embeddings=False)
    a, b = (plan_pipeline(_pipe(s, 1, 2, 4, 64, 4)) for s in (tied, untied))
    for key in ("params_per_rank", "weights", "grads", "optimizer"):
        assert [r[key] for r in a["stages"]] == [r[key] for r in b["stages"]], key
    table = 2 * tied.vocab_size * tied.dim
    assert [x["pp"] - y["pp"] for x, y in zip(a["comm"], b["comm"], strict=True)] == [table] * 2
    out = search_layouts(Step(tied, batch=4, seq=64), 4, 80e9)
    assert {r["pp"] for r in out["layouts"]} > {1}
