"""A rank that dies (SIGKILL) or stops answering (SIGSTOP) during training: the launcher and every
other rank exit non-zero, with one line naming the lost rank and what the others' collectives
said; ``tensorpar --timeout`` bounds how long a stopped rank can hold the others."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests_common import TINY_GPT, cli_env, rank_pids, tensorpar_here


def _lose_a_rank(run, how: int, *top_flags) -> tuple[int, str, float]:
    proc = subprocess.Popen([sys.executable, "-m", "tensorpar", *top_flags, "train", "--tp", "2",
                             "--steps", "100000", "--out", str(run), *TINY_GPT],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), start_new_session=True)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], how)  # rank 1: started second
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=90)
    finally:  # nothing left behind, whatever happened
        for pid, kill in ((proc.pid, os.killpg), (ranks[1], os.kill)):
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, err, time.monotonic() - t0


def test_dead_rank_is_named(tmp_path):
    rc, err, took = _lose_a_rank(tmp_path, signal.SIGKILL)
    assert rc == 1 and took < 30
    assert "Traceback" not in err, err
    # the other ranks' gloo message follows when they failed before the launcher saw the death
    assert err.strip().splitlines()[-1].startswith(
        "tensorpar train: rank(s) [1] died (exit codes [-9])"), err
    assert len(err.strip().splitlines()) == 1, err


def test_stopped_rank_times_out(tmp_path):
    """SIGSTOP: with --timeout 3 the others' collectives fail after 3 s, the launcher waits its
    grace for the stopped rank (3 s: no longer than the collective timeout), names it and stops
    everything."""
    rc, err, took = _lose_a_rank(tmp_path, signal.SIGSTOP, "--timeout", "3")
    assert rc == 1 and took < 3 + 3 + 15, took
    assert "Traceback" not in err, err
    assert "tensorpar train: ranks [1] did not finish; the other ranks' collectives: Timed out " \
        "waiting 3000ms" in err, err


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_timeout(value):
    out = tensorpar_here("--timeout", value, "train")
    assert out.returncode == 2 and f"--timeout {float(value)} must be > 0" in out.stderr
