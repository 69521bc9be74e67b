"""``tensorpar bench`` end to end on a tiny model: the real runner, real gloo ranks, the real
contenders, their losses against the dense fp32 run, and the files it writes."""

import argparse
import importlib.util
import json

import pytest
import torch

from tensorpar.bench.contenders import parse_contenders
from tensorpar.bench.outputs import table, write_results
from tensorpar.bench.runner import RunPlan, run_bench
from tensorpar.bench.workload import Workload, batch
from tensorpar.cli.bench import add_parser, main

TINY = Workload(dim=64, n_head=4, n_kv_head=2, n_layer=2, vocab_size=256, seq_len=16,
                 batch_size=2)
# every contender but megatron (tests/bench/test_bench_megatron.py); the compiled ones with
# aot_eager (it traces as inductor does, generates no code: seconds to compile)
NAMES = ["tensorpar", "tensorpar-sp", "tensorpar-sp-keep", "tensorpar-unfused", "tensorpar-c",
         "tensorpar-sp-c", "tensorpar-tp1", "tensorpar-tp1-c", "dtensor", "dtensor-sp",
         "dense-1t", "dense-Nt", "dense-c"]
if importlib.util.find_spec("transformers"):  # transformers' Llama through tensorpar.parallelize
    # (hf-llama-sp: the same setup with SP, exact in tests/hf); a user's loop (labels=), every
    # weight trained or LoRA adapters
    NAMES += ["hf-llama", "hf-llama-labels", "hf-llama-lora"]
    # a Qwen3-MoE of the same shape: tensorpar.parallelize against transformers' own TP + EP,
    # both against the model on one rank (their own loss reference)
    NAMES += ["hf-qwen3moe", "hf-qwen3moe-transformers", "hf-qwen3moe-1"]
ONE_RANK = ("tensorpar-tp1", "tensorpar-tp1-c", "dense-1t", "dense-Nt", "dense-c",
            "hf-qwen3moe-1")


def test_bench_runs_and_contenders_agree(ranks, tmp_path):
    """Every contender trains the same model from the same weights on the same batches: each
    step's loss equals the dense fp32 model's (the Qwen3-MoE rows: that model's on one rank) to
    1e-6 relative, over warmup and timed steps
    (~10x the largest measured, 8.6e-8 for the TP=2 rows, 0 for the one-rank ones; 2026-11-27,
    torch 2.13 CPU).
    The TP contenders communicate (bytes reported per kind); the dense one does not; the table,
    the JSON and the chart are written."""
    plan = RunPlan(repeats=2, steps_per_repeat=1, warmup=2, tp=2, compile_backend="aot_eager")
    results = run_bench(TINY, NAMES, plan, pool_for=lambda n, threads: ranks(n),
                        log=lambda s: None)
    rows = {r["name"]: r for r in results["contenders"]}
    assert list(rows) == NAMES
    assert [sorted(o) for o in results["round_orders"]] == [sorted(NAMES)] * plan.repeats
    n_steps = plan.warmup + plan.repeats * plan.steps_per_repeat
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["status"])
        assert len(row["losses"]) == n_steps and len(row["seconds"]) == 2, name
        if name == "hf-llama-lora":  # its own curve after the first step (B starts at zero)
            first = abs(row["losses"][0] - results["reference_losses"][0])
            assert first <= 1e-6 * results["reference_losses"][0], (name, row["losses"])
        else:
            assert row["loss_max_rel_diff"] <= 1e-6, (name, row["loss_max_rel_diff"])
        assert row["step_s"]["min"] <= row["step_s"]["median"] <= row["step_s"]["max"]
        # compiled: read off the profiler's allocator events (a TorchDispatchMode, the eager
        # rows' meter, would run them eagerly: ranks.setup)
        meter = "profiler" if name.endswith("-c") else "dispatch"
        assert all(m["meter"] == meter for m in row["memory"]), (name, row["memory"])
        assert all(m > 0 for m in row["peak_bytes_per_rank"]), name
        comm = row["comm_per_rank"]
        if name in ONE_RANK:
            assert comm["calls"] == {} and len(row["memory"]) == 1, name
        else:
            assert len(row["memory"]) == 2 and sum(comm["payload_bytes"].values()) > 0, name
    # one activation all-reduce (or its SP halves) is B*T*D*4 bytes; tensorpar moves the
    # Megatron minimum: 4 per block, the embedding's, the head's input gradient, the loss's
    act = TINY.batch_size * TINY.seq_len * TINY.dim * 4
    tp_comm = rows["tensorpar"]["comm_per_rank"]
    assert tp_comm["payload_bytes"]["all_reduce"] // act == 4 * TINY.n_layer + 2
    assert tp_comm["ring_bytes"]["all_reduce"] > 0
    assert rows["tensorpar-c"]["comm_per_rank"] == tp_comm  # counted eagerly (ranks.setup)
    assert rows["tensorpar-sp-c"]["comm_per_rank"] == rows["tensorpar-sp"]["comm_per_rank"]
    if "hf-llama" in rows:  # the converted HF Llama moves exactly what the GPT moves, with
        # labels= too (no logits gathered); LoRA as many collectives: its z and dz ride the
        # base's all-reduces, and the first block's input, needing no gradient (the embedding
        # is frozen), sums its attention's A gradients in place of its input gradient
        assert rows["hf-llama"]["comm_per_rank"] == tp_comm
        assert rows["hf-llama-labels"]["comm_per_rank"] == tp_comm
        lora = rows["hf-llama-lora"]["comm_per_rank"]["calls"]
        assert lora == tp_comm["calls"], lora
    if "hf-qwen3moe" in rows:  # each TP rank sends its half of the tokens' k rows to the
        # experts and back, forward and backward (4 N k D fp32 bytes a layer), and the E counts
        # once a layer (a call's payload is the larger of what it sends and receives: more
        # with uneven routing, equal on this seed); transformers' EP moves the same rows
        from tensorpar.bench.hf_moe import EXPERTS, TOP_K

        n = TINY.batch_size * TINY.seq_len // plan.tp
        a2a = TINY.n_layer * (4 * n * TOP_K * TINY.dim * 4 + EXPERTS * 8)
        ours = rows["hf-qwen3moe"]["comm_per_rank"]["payload_bytes"]["all_to_all"]
        theirs = rows["hf-qwen3moe-transformers"]["comm_per_rank"]["payload_bytes"]
        assert ours == theirs["all_to_all"] == a2a, (ours, theirs, a2a)
    # the losses move: the model learns the batches' successor structure
    ref = results["reference_losses"]
    assert ref[-1] < ref[0]

    paths = write_results(results, tmp_path / "bench", "tensorpar bench --test")
    md = paths["md"].read_text()
    assert all(f"| {n} |" in md for n in NAMES) and "tensorpar / dtensor" in md
    assert "| n/a |" not in md and "- compiled contenders' memory on the CPU: read off" in md
    data = json.loads(paths["json"].read_text())
    assert data["command"] == "tensorpar bench --test" and len(data["contenders"]) == len(NAMES)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "bench").glob(".*tmp*"))  # atomic writes leave nothing behind


def test_batches_are_seeded():
    """A batch depends only on (seed, step): the same on every call and every rank."""
    a, b = batch(TINY, 3), batch(TINY, 3)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not (batch(TINY, 4)[0] == a[0]).all()
    ids, targets = a
    assert ids.shape == targets.shape == (2, 16) and (ids[:, 1:] == targets[:, :-1]).all()


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_cli_flags_and_errors(capsys):
    """Every Workload field is a flag; bad input is refused with the flag and the number,
    before any rank is spawned."""
    args = _parse("--dim", "96", "--n-layer", "3", "--lr", "0.01", "--contenders",
                  "tensorpar,dense-1t", "--repeats", "4", "--profile")
    assert (args.dim, args.n_layer, args.lr, args.repeats, args.profile) == (96, 3, 0.01, 4, True)
    assert parse_contenders(args.contenders) == ["tensorpar", "dense-1t"]
    with pytest.raises(ValueError, match="unknown.*'nope'"):
        parse_contenders("tensorpar,nope")
    assert main(_parse("--contenders", "nope")) == 2
    assert main(_parse("--warmup", "1")) == 2
    assert main(_parse("--n-head", "3")) == 2
    assert main(_parse("--compile", "--compile-backend", "nope")) == 2
    assert main(_parse("--device", "tpu")) == 2
    err = capsys.readouterr().err
    assert "--warmup 1 must be >= 2" in err and "--n-head 3" in err
    assert "--compile-backend 'nope' is not a backend" in err and "--device tpu: expected" in err
    if not torch.cuda.is_available():
        assert main(_parse("--device", "cuda")) == 2
        assert "--device cuda: no CUDA GPU is visible" in capsys.readouterr().err


def test_gpu_table_has_tflops_and_mfu():
    """Where the bench measured a GPU's peak, the table adds model TFLOP/s and MFU, and states
    the peak; the compiled pair's ratio is a target there. (The GPU run itself:
    tests/test_cuda.py::test_bench_on_one_gpu.)"""
    def row(name, ms, mfu):
        return {"name": name, "status": "ok", "ranks_x_threads": "1x1", "tokens_per_s": 1e3,
                "step_s": dict.fromkeys(("median", "q1", "q3", "min", "max"), ms / 1e3),
                "model_tflops": 400.0 * mfu / 0.4, "mfu": mfu,
                "peak_bytes_per_rank": [2**30], "state_bytes_per_rank": [2**29],
                "memory": [{}], "loss_max_rel_diff": 1e-3,
                "comm_per_rank": {"calls": {}, "payload_bytes": {}, "ring_bytes": {}}}
    results = {"peak_flops": 1.0e15, "contenders": [
        row("tensorpar-tp1-c", 200.0, 0.44), row("dense-c", 198.0, 0.45),
        {"name": "tensorpar", "status": "skipped: needs 2 GPUs", "ranks_x_threads": "2x1"}]}
    md = table(results)
    head, rule, *body = md.splitlines()
    assert "| model TFLOP/s | MFU |" in head and rule.count("---") == head.count("|") - 1
    assert "| 440.0 | 44.0% |" in body[0] and body[2].count("|") == head.count("|")
    assert "bf16 matmul peak measured on this GPU: 1,000 TFLOP/s" in md
    assert "tensorpar-tp1-c / dense-c step time: 1.010 (target <= 1.00)" in md


def test_profile_categories():
    """Self CPU time by name; a Python-level range that issues a collective waits for it, but a
    compiled graph's call (which issues its functional collectives) spends its self time in
    inductor's fused kernels."""
    from tensorpar.bench.profiling import category

    assert category("aten::mm", False) == "matmul"
    assert category("aten::mul", True) == "optimizer"
    assert category("_FusedRow", False, issues_collective=True) == "collectives and waiting"
    assert category("_c10d_functional::wait_tensor", False) == "collectives and waiting"
    assert category("## Call CompiledFxGraph fabc ##", False, issues_collective=True) == \
        "elementwise/norm"
    assert category("CompiledFunction", False) == "framework"
