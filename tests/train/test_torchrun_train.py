"""``tensorpar train`` as torchrun's ranks: every rank ends a run the same way (a stop signal
that reaches one rank stops them all, and each exits 128 + the signal), and a wrong world size
is said once. Real torchrun, real signals; the wrong size on ranks forked from the session's
fork server with torchrun's environment (``docs_torchrun.torchrun_here``: no new interpreter
to import torch per rank; the command's path is the same, torchrun itself is the stop
test's)."""

import os
import signal
import subprocess
import sys
import time

from docs_torchrun import torchrun_here

from tests_common import TINY_GPT, child_pids, cli_env, read_metrics

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "tensorpar", "train"]


def _rank_of(pid: int) -> int:
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=", 1)[1])


def test_a_stop_under_torchrun_ends_every_rank_alike(tmp_path):
    """SIGUSR1 to rank 1 alone (a scheduler's warning, as ``--signal`` sends it): the ranks agree
    to stop, save the step, and both exit 138, which torchrun's report shows for each rank; rank 0
    says the one line. Before, ranks other than 0 ended with status 0 after a stop. The run
    under torchrun writes what a spawned one does: a metrics row per step, each rank's file."""
    proc = subprocess.Popen([*TORCHRUN, "--tp", "2", "--steps", "400", "--save-every", "50",
                             "--out", str(tmp_path), *TINY_GPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(tmp_path) if (tmp_path / "metrics.jsonl").exists() else []) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        ranks = {_rank_of(p): p for p in child_pids(proc.pid)}  # torchrun's workers
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = read_metrics(tmp_path)[-1]["step"]
    assert 5 <= last < 400, err
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, last + 1))
    assert (tmp_path / f"step-{last:08d}" / "rank01-of02.safetensors").is_file()
    assert err.count(f"tensorpar train: stopped by SIGUSR1 after step {last}; saved "
                     f"{tmp_path}/step-{last:08d}") == 1, err
    assert err.count("exitcode  : 138") == 2, err  # torchrun's report: one entry per rank
    assert "exitcode  : 0" not in err, err


def test_torchrun_with_the_wrong_size_says_so_once(tmp_path):
    run = torchrun_here(2, ["-m", "tensorpar", "train", "--tp", "4", "--steps", "2", "--out",
                            str(tmp_path / "run"), *TINY_GPT], tmp_path, cli_env(), timeout=180)
    assert run.returncode != 0
    line = "torchrun started 2 processes, which --tp 4 does not divide: start a multiple of 4 " \
           "in all (--nnodes x --nproc-per-node), or pass a --tp that divides 2"
    assert run.stderr.count(line) == 1, run.stderr
