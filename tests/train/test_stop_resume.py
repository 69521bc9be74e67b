"""Stopping and resuming ``tensorpar train`` as a cluster or a user does: SIGTERM / SIGUSR1
(preemption: finish the step, save, exit 143), Ctrl-C (stop at once, exit 130, say what is
kept), and ``--resume`` that keeps the stored learning-rate schedule and refuses what it cannot
honestly do. Real processes and signals."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.gpt.model import GPTConfig
from tensorpar.ranks.signals import StopRequest
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_model_rank
from tensorpar.train.run import resolve

from tests_common import (
    TINY_GPT,
    checkout_env,
    cli_env,
    importing_torch,
    ranks_met,
    read_metrics,
    tensorpar_here,
    wait_for,
)

STEPS = 80  # tiny steps of about 20 ms: the signal tests send theirs 35-55 steps before the end


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("whole")
    out = tensorpar_here("train", "--tp", 2, "--steps", STEPS, "--save-every", 20, "--out", run,
                         *TINY_GPT)
    assert out.returncode == 0, out.stderr
    return read_metrics(run), run


def _start(run, *flags):
    cmd = [sys.executable, "-m", "tensorpar", "train", "--tp", "2", "--steps", str(STEPS),
           "--save-every", "20", "--out", str(run), *TINY_GPT, *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), start_new_session=True)


def _wait_rows(proc, run, rows: int) -> None:
    """Until the run has written ``rows`` metrics rows."""
    deadline = time.monotonic() + 120
    while len(read_metrics(run) if (run / "metrics.jsonl").exists() else []) < rows:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def _signal_after(proc, run, rows: int, signals, group: bool = False, gap: float = 0.0,
                  wait: float = 0.0):
    """Wait until the run has written ``rows`` metrics rows, and ``wait`` seconds more, then send
    ``signals``, ``gap`` seconds apart (two of a kind sent at once would arrive as one)."""
    _wait_rows(proc, run, rows)
    time.sleep(wait)
    for i, s in enumerate(signals):
        time.sleep(gap if i else 0)
        (os.killpg if group else os.kill)(proc.pid, s)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.monotonic() - t0


def _same(resumed, whole):
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    for a, b in zip(resumed, whole, strict=True):
        assert a["loss"] == b["loss"] and a["lr"] == b["lr"], (a, b)


def _quiet(err: str) -> None:
    assert "Traceback" not in err and "leaked" not in err and "warning" not in err.lower(), err
    assert len(err.strip().splitlines()) == 1, err


def test_preemption_saves_the_step_and_resumes_exactly(tmp_path, uninterrupted):
    """SIGTERM to the launcher: the step in flight finishes, a checkpoint of that step is
    written, one line, exit 143. SIGTERMs that come once the run has stopped and said so (a
    cluster's repeated signal, or the user's) change nothing: still that one line and 143.
    ``--resume`` then equals the whole run."""
    proc = _start(tmp_path)
    _wait_rows(proc, tmp_path, 25)
    os.kill(proc.pid, signal.SIGTERM)
    said = proc.stderr.readline()
    for _ in range(10):  # while the launcher leaves (tenths of a second)
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 143 and rest == "", said + rest
    _quiet(said)
    last = read_metrics(tmp_path)[-1]["step"]
    assert 25 <= last < STEPS
    assert f"stopped by SIGTERM after step {last}; saved {tmp_path}/step-{last:08d}; resume " \
           f"with: tensorpar train --resume --out {tmp_path}" in said, said
    out = tensorpar_here("train", "--resume", "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    _same(read_metrics(tmp_path), uninterrupted[0])


def test_ctrl_c_stops_at_once_and_says_what_is_kept(tmp_path, uninterrupted):
    """Ctrl-C reaches the launcher and its ranks (the terminal's process group): exit 130 within
    seconds, one line naming the last step and checkpoint, no partial checkpoint; ``--resume``
    then equals the whole run."""
    rc, err, took = _signal_after(_start(tmp_path), tmp_path, 45, [signal.SIGINT], group=True)
    assert rc == 130, err
    _quiet(err)
    assert took < 10
    last = read_metrics(tmp_path)[-1]["step"]
    ckpt = find_checkpoint(tmp_path)  # --save-every 20; a step's row comes before its save,
    kept = int(ckpt.name.split("-")[1])  # which the interrupt may have cut short
    assert 45 <= last < STEPS and kept % 20 == 0 and 40 <= kept <= last < kept + 21, (last, ckpt)
    lost = f"; steps {kept + 1}-{last} are lost" if last > kept else ""
    assert f"interrupted (Ctrl-C) after step {last}; last checkpoint {ckpt} (step {kept}){lost}; " \
           f"resume with: tensorpar train --resume --out {tmp_path}" in err, err
    assert not list(tmp_path.glob(".*.tmp")), list(tmp_path.iterdir())
    out = tensorpar_here("train", "--resume", "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    _same(read_metrics(tmp_path), uninterrupted[0])


@pytest.mark.parametrize("command", ["generate", "verify"])
def test_ctrl_c_in_other_commands(uninterrupted, command):
    """Ctrl-C while the ranks of ``generate`` or ``verify`` work: exit 130, one line."""
    args = {"generate": ["--ckpt", uninterrupted[1], "--prompt", "The", "--max-new-tokens",
                         "100000"],
            "verify": ["--seq-len", "2048", "--dim", "512", "--hidden-dim", "4096",
                            "--batch-size", "8"]}[command]  # 20 s of work on 2 cores
    proc = subprocess.Popen([sys.executable, "-m", "tensorpar", command, "--tp", "2",
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(), start_new_session=True)
    wait_for(lambda: ranks_met(proc.pid, 2), proc, "process group of 2 ranks")
    os.killpg(proc.pid, signal.SIGINT)  # while the ranks work (20 s of it)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip() == f"tensorpar {command}: interrupted (Ctrl-C)", err


def test_second_signal_stops_at_once(tmp_path):
    """A second SIGTERM while the first waits for its step: stop at once, one line. Both are
    sent inside step 2, at a fifth and two fifths of step 1's time after its row (1.5 s here):
    a row is written just before the ranks agree on a stop, so a signal sent as row 1 appears
    could still stop the run after step 1; and sent after a fixed delay, the second signal came
    during the save on a machine with quicker steps. Two signals of a kind may also reach the
    launcher as one (POSIX merges a pending signal with its repeat, and Python runs a handler
    once for both when its main thread comes late, as on a machine loaded by other tests): a
    run that ends as after one SIGTERM is tried once more, a second time in a new directory.
    What tells "at once" from "after the step" is what the run kept (step 1's row and no
    checkpoint, where the first signal alone finishes step 2 and saves it), not the clock: the
    launcher leaves 1.1 to 1.4 s after the second signal on an idle machine, and took 10.7 s
    once on a loaded one."""
    wide = ["--dim", "256", "--n-layer", "4", "--seq-len", "256", "--batch-size", "32"]
    for attempt in (tmp_path / "first", tmp_path / "again"):
        proc = _start(attempt, *wide)
        _wait_rows(proc, attempt, 1)
        step = read_metrics(attempt)[0]["step_time_s"]
        rc, err, _ = _signal_after(proc, attempt, 1, [signal.SIGTERM] * 2, gap=step / 5,
                                   wait=step / 5)
        if "stopped by SIGTERM" not in err:  # the two were not merged
            break
    assert rc == 143, err
    assert "interrupted (SIGTERM) after step 1, before the first checkpoint" in err, err
    _quiet(err)
    assert len(read_metrics(attempt)) == 1 and find_checkpoint(attempt) is None


def _usr1_on(rank_to_signal: int) -> tuple[int, int]:
    import torch.distributed as dist

    with StopRequest() as stop:
        before = stop.agreed()
        if dist.get_rank() == rank_to_signal:
            os.kill(os.getpid(), signal.SIGUSR1)
        return before, stop.agreed()


def test_ranks_agree_on_a_signal_one_of_them_got(ranks):
    """SIGUSR1 reaching rank 2 alone: every rank's next check says SIGUSR1, none before."""
    assert ranks(3).run(_usr1_on, 2) == [(0, signal.SIGUSR1)] * 3


MODEL = {"n_layer": 1, "dim": 32, "n_head": 4, "n_kv_head": 1}
TRAIN = {"tp": 1, "seq_len": 32, "batch_size": 4, "warmup_steps": 3, "seed": 2}


def _resolve(model=None, **train):
    """``resolve`` with flags given as the CLI gives them (None: not on the command line)."""
    return resolve({f.name: None for f in dataclasses.fields(TrainConfig)} | train,
                   {f.name: None for f in dataclasses.fields(GPTConfig)} | (model or {}))


def _train(ranks, model=None, **train):
    cfg, recipe, resume_from = _resolve(model, **train)
    return ranks(1).run(train_model_rank, cfg, recipe, resume_from)[0]["rows"]


def test_resume_keeps_the_schedule(ranks, tmp_path, capsys):
    """``--steps 8`` then ``--resume --steps 14`` equals one run of ``--steps 14
    --lr-decay-steps 8``, and says it kept the schedule; another horizon asked for explicitly
    gives the note that the run is no longer an exact continuation."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _train(ranks, MODEL, **TRAIN, steps=8, out=a)
    resumed = _train(ranks, resume=True, steps=14, out=a)
    assert "keeping the run's learning-rate schedule (cosine decay to lr/10 at step 8" \
        in capsys.readouterr().err
    whole = _train(ranks, MODEL, **TRAIN, steps=14, lr_decay_steps=8, out=b)
    _same(resumed, whole)
    assert whole[-1]["lr"] == pytest.approx(1e-4)  # lr/10 from step 8 on
    cfg = _resolve(resume=True, steps=16, lr_decay_steps=16, out=a)[0]
    assert cfg.lr_decay_steps == 16 and "--lr-decay-steps differ" in capsys.readouterr().err


def test_resume_edge_cases(tmp_path, uninterrupted):
    """A folder that does not exist is an error; one without a checkpoint starts over with a
    note; a run already at --steps says so and starts no rank; a new run never overwrites an
    earlier run's metrics.jsonl."""
    missing = tmp_path / "typo"
    out = tensorpar_here("train", "--resume", "--out", missing, *TINY_GPT)
    assert out.returncode == 2 and f"--resume: {missing} does not exist" in out.stderr
    assert not missing.exists()
    done = uninterrupted[1]
    t0 = time.monotonic()
    out = tensorpar_here("train", "--resume", "--steps", 30, "--out", done)
    assert out.returncode == 0 and f"{done} is already at step {STEPS} (--steps 30): nothing " \
        "to train" in out.stderr, out.stderr
    assert "step 1/" not in out.stdout and time.monotonic() - t0 < 15
    assert len(read_metrics(done)) == STEPS
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    out = tensorpar_here("train", "--out", stale, *TINY_GPT)
    assert out.returncode == 2 and "holds the metrics.jsonl of an earlier run" in out.stderr
    assert (stale / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    out = tensorpar_here("train", "--resume", "--tp", 1, "--steps", 2, "--out", stale, *TINY_GPT)
    assert out.returncode == 0 and "no checkpoint in" in out.stderr, out.stderr
    assert [r["step"] for r in read_metrics(stale)] == [1, 2]


def test_ctrl_c_while_torch_is_imported():
    """Ctrl-C in the first second of a command, while ``python -m tensorpar`` still imports
    torch and before any rank starts: exit 130 and one line, no Python traceback. (A Ctrl-C
    while the launcher starts the fork server is ignored, as the server must inherit SIGINT
    ignored: ranks/forkserver.py. So the test presses it again, as a user would.)"""
    proc = subprocess.Popen([sys.executable, "-m", "tensorpar", "verify", "--tp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), start_new_session=True)
    # past the interpreter's own start, inside torch's import (seconds)
    wait_for(lambda: importing_torch(proc.pid), proc, "import of torch", every=0.005)
    for _ in range(20):
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["tensorpar verify: interrupted (Ctrl-C)"], err


def _entry_point(tmp_path, patch: str) -> subprocess.CompletedProcess:
    """``python -m tensorpar`` with no command, its start patched by ``patch``: run with ``-m``
    as well, since CPython ends ``-c`` and script runs by another path."""
    (tmp_path / "entry.py").write_text(
        f"import os, signal, sys, tensorpar.__main__ as m, tensorpar.cli.main\n{patch}\n"
        "sys.argv = ['tensorpar']\nm.run()\n")
    env = checkout_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "entry"], capture_output=True, text=True,
                          env=env, timeout=120)


def test_ctrl_c_caught_in_code_run_from_a_string_exits_130(tmp_path):
    """A Ctrl-C that lands in code an import runs through ``exec`` (namedtuple, dataclasses):
    CPython 3.11 would end the process by SIGINT (status -2) though it was caught and said."""
    run = _entry_point(tmp_path, "def main():\n    exec('raise KeyboardInterrupt')\n"
                       "tensorpar.cli.main.main = main")
    assert run.returncode == 130, run
    assert run.stderr.splitlines() == ["tensorpar: interrupted (Ctrl-C)"], run.stderr


def test_ctrl_c_while_importing_is_held_until_the_imports_end(tmp_path):
    """A Ctrl-C while torch and the library import is raised once they have (a KeyboardInterrupt
    inside a C++ extension's start can abort the process): the import finishes, then 130."""
    run = _entry_point(tmp_path, "def start(argv):\n    os.kill(os.getpid(), signal.SIGINT)\n"
                       "    print('imports went on')\nm.start_early = start\n"
                       "tensorpar.cli.main.main = lambda: print('the command ran')")
    assert run.returncode == 130 and run.stdout == "imports went on\n", run
    assert run.stderr.splitlines() == ["tensorpar: interrupted (Ctrl-C)"], run.stderr
