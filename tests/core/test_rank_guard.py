"""Under torchrun each rank runs under a small parent (``tensorpar/runtime/rank_guard.py``): when
every rank aborts, each parent still names its rank and gives the ``--check-collectives`` hint;
torchrun's stop signal reaches the rank exactly once; the exit status passes through."""

import signal
import subprocess
import sys
import time

from tensorpar.ranks.checking import CHECK_HINT
from tensorpar.ranks.rank_guard import HINT
from tensorpar.runtime.groups import CHECK_ENV

from tests_common import checkout_env

# what ``python -m tensorpar`` does first under torchrun, then a rank that aborts as gloo's
# C++ terminate does after ranks fed a collective different shapes: on every rank
ABORTS = '''
from tensorpar.ranks.rank_guard import guard_rank
guard_rank("train")
import os
print(f"rank {os.environ['RANK']} aborts", flush=True)
os.abort()
'''

# a rank that counts the SIGTERMs it gets while torchrun stops it, then exits as tensorpar does
STOPPED = '''
import os, signal, sys, time
from pathlib import Path
from tensorpar.ranks.rank_guard import guard_rank
guard_rank("train")
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
Path(f"ready{os.environ['RANK']}").touch()
end = time.monotonic() + 20
while time.monotonic() < end and not got:
    time.sleep(0.05)
time.sleep(1.0)  # a second signal, if one came, would be counted by now
print(f"rank {os.environ['RANK']}: {len(got)} SIGTERM", flush=True)
sys.exit(143 if got else 0)
'''


def _torchrun(script, tmp_path, **kw):
    path = tmp_path / "rank.py"
    path.write_text(script)
    env = {k: v for k, v in checkout_env().items() if k != CHECK_ENV}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path, **kw)


def test_every_rank_aborts(tmp_path):
    """No rank is left to say it: the parent says which rank aborted, with the hint; torchrun's
    report still names SIGABRT; all done within 30 s."""
    assert HINT == CHECK_HINT  # the local launcher's hint and this one are the same words
    start = time.monotonic()
    run = _torchrun(ABORTS, tmp_path)
    out, _ = run.communicate(timeout=60)
    assert run.returncode != 0 and time.monotonic() - start < 30, out
    # the first rank to abort says so; torchrun may stop the other before it aborts (SIGTERM)
    lines = [x for x in out.splitlines() if x.startswith("tensorpar train: rank ")]
    assert lines, out
    for line in lines:
        assert "aborted (SIGABRT" in line and line.endswith(HINT), line
    assert "Signal 6 (SIGABRT)" in out, out  # torchrun's report, as without the parent


def test_torchrun_stop_reaches_the_rank_once(tmp_path):
    """torchrun stops its ranks with killpg(SIGTERM): the parent gets it and forwards it once
    (a second would mean "stop at once" to ``tensorpar train``); the rank's 143 passes through."""
    run = _torchrun(STOPPED, tmp_path)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    assert "rank 0: 1 SIGTERM" in out and "rank 1: 1 SIGTERM" in out, out
    assert run.returncode != 0, out
    assert "tensorpar train: rank" not in out, out  # a requested stop is no crash
