"""Under torchrun each process is a rank that ``python -m tensorpar`` starts with
``faulthandler`` on: a rank that aborts (gloo's C++ terminate after ranks fed a collective
different shapes) prints its Python stack, and torchrun's report names the rank and the signal;
torchrun's stop signal reaches the rank once (its own process group), and the exit status of
the command passes through."""

import subprocess
import sys
import time

from tensorpar.runtime.groups import CHECK_ENV

from tests_common import checkout_env

# ``python -m tensorpar CMD`` whose command aborts on every rank, as gloo's terminate does
ABORTS = '''
import os, sys, tensorpar.__main__ as entry, tensorpar.cli.main
def main():
    print(f"rank {os.environ['RANK']} aborts", flush=True)
    os.abort()
tensorpar.cli.main.main = main
sys.argv = ["tensorpar", "train"]
entry.run()
'''

# a command that counts the SIGTERMs it gets while torchrun stops it, then exits as tensorpar's
# stopped training does (143)
STOPPED = '''
import os, signal, sys, time, tensorpar.__main__ as entry, tensorpar.cli.main
from pathlib import Path
def main():
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    Path(f"ready{os.environ['RANK']}").touch()
    end = time.monotonic() + 20
    while time.monotonic() < end and not got:
        time.sleep(0.05)
    Path(f"stopping{os.environ['RANK']}").touch()
    # a second SIGTERM, if torchrun sent one, lands while the command still listens
    end = time.monotonic() + 1.0
    while time.monotonic() < end and len(got) < 2:
        time.sleep(0.05)
    print(f"rank {os.environ['RANK']}: {len(got)} SIGTERM", flush=True)
    return 143 if got else 0
tensorpar.cli.main.main = main
sys.argv = ["tensorpar", "train"]
entry.run()
'''


def _torchrun(script, tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(script)
    env = {k: v for k, v in checkout_env().items() if k != CHECK_ENV}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path)


def test_every_rank_aborts(tmp_path):
    """No rank is left to say it: each aborting rank prints its Python stack (faulthandler,
    with tensorpar's entry point in it), torchrun's report names SIGABRT and the rank; all done
    within 30 s."""
    start = time.monotonic()
    run = _torchrun(ABORTS, tmp_path)
    out, _ = run.communicate(timeout=60)
    assert run.returncode != 0 and time.monotonic() - start < 30, out
    assert "Fatal Python error: Aborted" in out and "tensorpar/__main__.py" in out, out
    assert "Signal 6 (SIGABRT)" in out and "rank      : " in out, out


def test_torchrun_stop_reaches_the_rank_once(tmp_path):
    """torchrun stops its ranks with killpg(SIGTERM), each rank in a process group of its own:
    one SIGTERM each (a second would mean "stop at once" to ``tensorpar train``); the command's
    143 passes through."""
    run = _torchrun(STOPPED, tmp_path)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
        time.sleep(0.1)
    run.send_signal(subprocess.signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    assert "rank 0: 1 SIGTERM" in out and "rank 1: 1 SIGTERM" in out, out
    assert run.returncode != 0, out
    assert "Fatal Python error" not in out, out  # a requested stop is no crash
