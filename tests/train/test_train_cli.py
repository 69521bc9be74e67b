"""``tensorpar train``, ``generate`` and ``export`` end to end, as a user runs them: spawned
ranks and torchrun, a real kill and ``--resume``, resharding, clear errors. The first run is
a new process (rank 0 prints its summary on the process's stdout), and so is the run that is
killed; runs that only compare with them (TP=1, the resume after the kill, generate, the dense
export) go through the same entry in this process (``tensorpar_here``), 5 s less each.
Training under torchrun: tests/train/test_torchrun_train.py and tests/dp/test_multinode.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests_common import TINY_GPT, cli_env, rank_pids, read_metrics, tensorpar_cli, tensorpar_here


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TP=2 run of 20 steps (checkpoints every 5)."""
    run = tmp_path_factory.mktemp("tp2")
    out = tensorpar_cli("train", "--tp", 2, "--steps", 20, "--save-every", 5, "--out", run,
                        *TINY_GPT)
    assert out.returncode == 0, out.stdout + out.stderr
    return run, out.stdout


def test_train_outputs(trained):
    """metrics.jsonl has one row per step with loss and tokens/s; loss.png is a PNG; the summary
    names the loss, the per-rank share of the parameters and the bytes per collective."""
    run, stdout = trained
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all({"loss", "tokens_per_s", "lr", "grad_norm"} <= r.keys() for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for text in ("loss (first -> final step)", "tokens/s", "rank 1", "all_reduce per step",
                 "payload"):
        assert text in stdout, stdout
    manifest = json.loads((run / "step-00000020" / "manifest.json").read_text())
    assert manifest["tp_size"] == 2 and manifest["step"] == 20
    assert manifest["data"]["position"]["sequences"] == 80
    assert sorted(os.listdir(run)) == ["loss.png", "metrics.jsonl", "step-00000015",
                                       "step-00000020"]


def test_tp1_equals_tp2_step_by_step(trained, tmp_path):
    run, _ = trained
    out = tensorpar_here("train", "--tp", 1, "--steps", 20, "--out", tmp_path, *TINY_GPT)
    assert out.returncode == 0, out.stderr
    for a, b in zip(read_metrics(tmp_path), read_metrics(run), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_then_resume(trained, tmp_path):
    """SIGKILL to the launcher alone of a TP=2 run (``kill -9 PID``, not its group) after its
    step-5 checkpoint: its ranks exit too. Then ``--resume`` at TP=4 with no other flag: the run
    finishes at step 20 and its metrics equal the uninterrupted run's."""
    cmd = [sys.executable, "-m", "tensorpar", "train", "--tp", "2", "--steps", "20",
           "--save-every", "5", "--out", str(tmp_path), *TINY_GPT]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=cli_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "step-00000005" / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(r) for r in ranks):
            assert time.monotonic() < deadline, "ranks still running after their launcher died"
            time.sleep(0.05)
    finally:  # nothing left behind, whatever happened
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = tensorpar_here("train", "--resume", "--tp", 4, "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resuming from" in out.stderr
    for a, b in zip(read_metrics(tmp_path), read_metrics(trained[0]), strict=True):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)


def test_generate_same_text_at_any_tp(trained):
    """Sampled text from the TP=2 checkpoint is identical at TP=1 and 2 as the CLI prints it
    (greedy, top-k, top-p and batches at TP=1 to 4: tests/gpt/test_generate.py); the prompt
    comes first on stdout. (A new process runs generate in tests/hf/test_hf_export.py.)"""
    temperature = "0.8"
    texts = []
    for tp in (1, 2):
        out = tensorpar_here("generate", "--ckpt", trained[0], "--tp", tp, "--prompt", "The ",
                  "--max-new-tokens", 24, "--temperature", temperature, "--seed", 3)
        assert out.returncode == 0, out.stderr
        texts.append(out.stdout)
    assert texts[0] == texts[1]
    assert texts[0].startswith("The ") and len(texts[0].encode()) > 4 + 12


def test_export_dense(trained, tmp_path):
    out = tensorpar_here("export", "--ckpt", trained[0], "--out", tmp_path / "gpt.safetensors")
    assert out.returncode == 0, out.stderr
    weights = load_file(tmp_path / "gpt.safetensors")
    assert weights["embed.weight"].shape == (256, 32)
    assert weights["blocks.0.mlp.gate.weight"].shape == (96, 32)  # 8/3 * 32, rounded up to 32
    assert weights["blocks.0.attn.k_proj.weight"].shape == (8, 32)  # one KV head of 8
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.mark.parametrize("args,message", [
    (["train", "--tp", 3, "--n-head", 2, "--dim", 32], "num_heads=2 cannot be split over 3"),
    (["train", "--tp", 4, "--sequence-parallel", "--seq-len", 3], "--seq-len 3 is shorter than"),
    (["train", "--data", "/nonexistent.txt"], "--data /nonexistent.txt: no such file"),
    (["generate", "--ckpt", "/nonexistent", "--prompt", "x"], "no checkpoint in /nonexistent"),
    (["train", "--vocab-size", 100], "--vocab-size 100: the tokenizer, bytes (256 tokens), "
     "needs 256"),
    (["train", "--lr", -1], "--lr -1.0 must be > 0"),
])
def test_bad_requests_exit_2(args, message):
    out = tensorpar_here(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_bad_checkpoints_exit_2(trained, tmp_path):
    """Resuming with a model flag that disagrees, or from a corrupted file: one clear line."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    out = tensorpar_here("train", "--resume", "--out", run, "--dim", 64)
    assert out.returncode == 2 and "--dim 64 disagrees with the checkpoint" in out.stderr
    shard = run / "step-00000020" / "rank01-of02.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3] + b"xyz")
    for args in (["train", "--resume", "--out", run],
                 ["generate", "--ckpt", run, "--prompt", "x"]):
        out = tensorpar_here(*args)
        assert out.returncode == 2 and "rank01-of02.safetensors is corrupted" in out.stderr, \
            out.stderr


def test_short_data_and_bad_generate_flags(trained, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    out = tensorpar_here("train", "--data", short, "--out", tmp_path / "run", *TINY_GPT)
    assert out.returncode == 2 and "fewer than --seq-len 32 + 1 tokens" in out.stderr
    for flags, message in ((["--tp", 0], "--tp 0 must be >= 1"),
                           (["--temperature", "nan"], "--temperature nan >= 0")):
        out = tensorpar_here("generate", "--ckpt", trained[0], "--prompt", "x", *flags)
        assert out.returncode == 2 and message in out.stderr, out.stderr
