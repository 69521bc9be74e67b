"""The commands end to end at the smallest sizes, for the fast tier (the full suite runs each at
real sizes in its own files): ``bench`` with two contenders, ``train`` at TP=2 in this process
with W&B offline, a run cut after step 2 and resumed, ``generate`` and ``export`` of its
checkpoint, and ``train --compile`` with the aot_eager backend."""

import json

import pytest
from safetensors.torch import load_file

from tensorpar.bench.runner import RunPlan, run_bench
from tensorpar.bench.workload import Workload

from tests_common import TINY_GPT, read_metrics, tensorpar_here

STEPS = ["--steps", "4", "--save-every", "2"]


def test_bench_with_two_contenders(ranks):
    """tensorpar at TP=2 and the dense model on one rank train the same tiny model: each step's
    loss equals the dense fp32 model's to 1e-6 relative; tensorpar's row communicates, the
    dense one does not."""
    work = Workload(dim=32, n_head=4, n_kv_head=2, n_layer=1, vocab_size=96, seq_len=8,
                    batch_size=2)
    plan = RunPlan(repeats=1, steps_per_repeat=1, warmup=2, tp=2)
    results = run_bench(work, ["tensorpar", "dense-1t"], plan,
                        pool_for=lambda n, threads: ranks(n), log=lambda s: None)
    rows = {r["name"]: r for r in results["contenders"]}
    assert list(rows) == ["tensorpar", "dense-1t"]
    for name, row in rows.items():
        assert row["status"] == "ok" and row["loss_max_rel_diff"] <= 1e-6, (name, row)
    assert rows["tensorpar"]["comm_per_rank"]["payload_bytes"]["all_reduce"] > 0
    assert rows["dense-1t"]["comm_per_rank"]["calls"] == {}


@pytest.fixture(scope="module")
def run(tmp_path_factory, monkeypatch_module):
    """``train --tp 2`` of the tiny GPT for 4 steps, in this process, logging to W&B offline."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    monkeypatch_module.setenv("WANDB_MODE", "offline")
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    done = tensorpar_here("train", "--tp", 2, *STEPS, "--wandb", "--out", out, *TINY_GPT)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_train_logs_every_step_to_wandb_offline(run):
    """4 rows, the loss falling; W&B's offline run, named by the run's id, holds each loss."""
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    run_id = (run / "wandb-id").read_text().strip()
    files = (run / "wandb").glob(f"offline-run-*-{run_id}/*.wandb")
    logged = b"".join(p.read_bytes() for p in files)
    assert all(json.dumps(r["loss"]).encode() in logged for r in rows)


def test_cut_and_resumed_run_repeats_the_whole(run, tmp_path):
    """A run of the same flags cut after step 2 (the schedule's horizon kept at 4) and resumed
    takes steps 3 and 4 as the uninterrupted run, bit for bit."""
    out = tmp_path / "cut"
    done = tensorpar_here("train", "--tp", 2, "--steps", 2, "--lr-decay-steps", 4, "--out", out,
                          *TINY_GPT)
    assert done.returncode == 0, done.stderr
    done = tensorpar_here("train", "--resume", "--steps", 4, "--out", out)
    assert done.returncode == 0, done.stderr
    key = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out)]
    assert key == [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run)]


def test_generate_and_export_the_checkpoint(run, tmp_path):
    """``generate --ckpt`` prints the prompt and its continuation, the same at TP=1 and 2;
    ``export`` writes the dense weights, the embedding whole."""
    said = [tensorpar_here("generate", "--ckpt", run, "--tp", tp, "--prompt", "The with",
                           "--max-new-tokens", 6) for tp in (1, 2)]
    assert all(s.returncode == 0 for s in said), [s.stderr for s in said]
    assert said[0].stdout == said[1].stdout and said[0].stdout.startswith("The with")
    done = tensorpar_here("export", "--ckpt", run, "--out", tmp_path / "dense.safetensors")
    assert done.returncode == 0, done.stderr
    weights = load_file(tmp_path / "dense.safetensors")
    assert weights["embed.weight"].shape == (256, 32)


def test_compiled_training_follows_eager(run, tmp_path):
    """``train --compile --compile-backend aot_eager`` at TP=2: the eager run's losses and
    gradient norms to 1e-5 relative."""
    out = tmp_path / "compiled"
    done = tensorpar_here("train", "--tp", 2, *STEPS, "--compile", "--compile-backend",
                          "aot_eager", "--out", out, *TINY_GPT)
    assert done.returncode == 0, done.stderr
    for a, b in zip(read_metrics(out), read_metrics(run), strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a, b)


def test_compile_preloads_what_the_first_compile_imports():
    """``train --compile`` has the ranks' fork server import torch.compile's own modules (AOT
    autograd, the partitioner: 1 s a rank), ``--hf`` transformers' model code, and neither for a
    plain run; every module named exists in this torch (the server skips a name that fails)."""
    import importlib.util

    from tensorpar.ranks.forkserver import COMMAND_MODULES, COMPILE_MODULES, HF_MODULES, preload_for

    assert preload_for("train", ["train", "--tp", "2"]) == COMMAND_MODULES["train"]
    assert preload_for("train", ["train", "--compile", "--hf", "m"]) == \
        COMMAND_MODULES["train"] + HF_MODULES + COMPILE_MODULES
    assert all(importlib.util.find_spec(name) is not None for name in COMPILE_MODULES)
