"""Failures while saving: nothing non-finite is ever written (every rank refuses alike), and a
save that runs out of space (``ulimit -f``) ends in one line, keeps the previous checkpoint and
leaves nothing behind."""

import os
import resource
import shutil
import subprocess
import sys
import time

import pytest
import torch
from docs_torchrun import torchrun_here

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.ownership import ShardOwnership
from tensorpar.runtime.groups import tp_rank
from tensorpar.train.config import TrainConfig
from tensorpar.train.optim import make_optimizer

from tests_common import TINY_GPT, cli_env, leftovers, live_processes, tensorpar_here

TINY = {"vocab_size": 50, "n_layer": 1, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 40}


def _save_with_nan(path, bad_rank, name):
    """Every rank saves; ``bad_rank`` first puts a NaN into its shard of ``name``."""
    model = GPT(GPTConfig(**TINY), seed=3)
    if tp_rank() == bad_rank:
        with torch.no_grad():
            dict(model.named_parameters())[name].view(-1)[0] = float("nan")
    try:
        save_checkpoint(path, 7, model, ShardOwnership.gather(model), meta={"config": {}})
    except ValueError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("n", [1, 2])
def test_nonfinite_never_saved(ranks, tmp_path, n):
    """A NaN in one rank's shard: every rank raises the same ValueError naming the tensor and
    the rank, and nothing is written."""
    name = "blocks.0.attn.q_proj.weight"
    said = ranks(n).run(_save_with_nan, str(tmp_path), n - 1, name)
    assert said == [f"refusing to save step 7: {name} holds nan (rank {n - 1})"] * n
    assert os.listdir(tmp_path) == []


def test_nonfinite_optimizer_state_never_saved(tmp_path):
    """An infinity in an AdamW moment is refused too (world size 1, no launcher)."""
    model = GPT(GPTConfig(**TINY), seed=3)
    opt = make_optimizer(model, TrainConfig())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    opt.state[model.norm.weight]["exp_avg_sq"][0] = float("inf")
    with pytest.raises(ValueError, match=r"^refusing to save step 2: optimizer.exp_avg_sq.norm."
                                         r"weight holds inf \(rank 0\)$"):
        save_checkpoint(tmp_path, 2, model, ShardOwnership.gather(model), opt, meta={"config": {}})
    assert os.listdir(tmp_path) == []


def _limit_file_size(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return apply


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A TP=2 run of 2 steps, its checkpoint at step 2, and a file size limit between its two
    shards' sizes (TINY_GPT: rank 0's file is 127 KB, rank 1's 119 KB)."""
    run = tmp_path_factory.mktemp("saved")
    out = tensorpar_here("train", "--tp", 2, "--steps", 2, "--save-every", 2, "--out", run,
                         *TINY_GPT)
    assert out.returncode == 0, out.stderr
    sizes = sorted((run / "step-00000002" / f"rank{r:02d}-of02.safetensors").stat().st_size
                   for r in range(2))
    return run, (sizes[0] + sizes[1]) // 2


def test_file_too_large_save(saved, tmp_path):
    """``ulimit -f`` between the two ranks' shard sizes, so one rank's write fails while the
    other's succeeds: one line naming the file and the cause, exit 1, no traceback, every
    process gone; the previous checkpoint is intact (the one a resume takes) and nothing hidden is
    left."""
    run, limit = tmp_path / "run", saved[1]
    shutil.copytree(saved[0], run)
    cmd = [sys.executable, "-m", "tensorpar", "train", "--resume", "--steps", "4", "--out",
           str(run)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), start_new_session=True,
                            preexec_fn=_limit_file_size(limit))
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    while _session_left(proc.pid) and time.monotonic() < start + 30:  # the ranks, and
        time.sleep(0.1)  # multiprocessing's resource tracker, which exits after the launcher
    took = time.monotonic() - start
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("tensorpar train: ranks 0, 1: File too large: '"), stderr
    assert line.endswith("/.step-00000004.tmp/rank00-of02.safetensors'"), stderr
    assert _session_left(proc.pid) == [] and took < 30, "processes left after 30 s"
    assert leftovers(run) == [] and sorted(os.listdir(run)) == [
        "loss.png", "metrics.jsonl", "step-00000002"]
    assert find_checkpoint(run) == run / "step-00000002"  # what --resume takes, intact:
    CheckpointReader(run / "step-00000002").verify()  # (resuming from it: test_stop_resume.py)


# a torchrun rank under ``ulimit -f LIMIT``: ``python -m tensorpar ARGV``
LIMITED_RANK = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
sys.argv = ["tensorpar", *{argv!r}]
runpy.run_module("tensorpar", run_name="__main__", alter_sys=True)
"""


def test_file_too_large_under_torchrun(saved, tmp_path):
    """The same under torchrun: each rank says its line (``rank R: File too large: ...``) and
    exits 1; no traceback of ours; the checkpoint is kept. The ranks are forked from the
    session's fork server with torchrun's environment (``docs_torchrun.torchrun_here``: no new
    interpreter importing torch per rank; torchrun itself: tests/train/test_torchrun_train.py)."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    argv = ["train", "--tp", "2", "--resume", "--steps", "4", "--out", str(run)]
    (tmp_path / "rank.py").write_text(LIMITED_RANK.format(limit=saved[1], argv=argv))
    out = torchrun_here(2, ["rank.py"], tmp_path, cli_env(), timeout=120)
    assert out.returncode == 1, out.stderr
    for rank in (0, 1):
        assert (f"tensorpar train: rank {rank}: File too large: '{run}/.step-00000004.tmp/"
                "rank00-of02.safetensors'") in out.stderr, out.stderr
    assert "save_checkpoint" not in out.stderr and "OSError" not in out.stderr, out.stderr
    assert leftovers(run) == [] and sorted(os.listdir(run)) == [
        "loss.png", "metrics.jsonl", "step-00000002"]


def _session_left(sid: int) -> list[str]:
    """The command lines of the live processes of session ``sid``."""
    return [cmd for _, _, session, cmd in live_processes() if session == sid]
