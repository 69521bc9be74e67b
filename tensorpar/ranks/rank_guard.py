"""Under torchrun, a small parent around each rank that can speak when the rank no longer can.

A rank killed by a signal it did not ask for (gloo's C++ ``terminate`` after ranks fed a
collective different shapes: SIGABRT; a crash: SIGSEGV, SIGBUS) runs no more Python: no line of
its own, and when every rank aborts, no surviving rank is left to say what happened (the local
launcher, ``launch.py``, says it for ranks it spawned). So ``python -m tensorpar CMD`` under
torchrun forks the rank first thing, before torch is imported (a fork of a bare interpreter: a
millisecond), and the process torchrun started stays as its parent::

    torchrun ── python -m tensorpar train   (this parent: waits, forwards signals, reports)
                   └── the rank             (its own process group; dies with the parent)

- The rank's exit status becomes the parent's; a rank killed by a signal kills the parent with
  the same signal, so torchrun's report names it as before ("Signal 6 (SIGABRT)").
- Before that, for the signals of a crash, the parent prints one line: which rank, which signal,
  and the ``--check-collectives`` hint (the abort's own message is above it).
- torchrun stops its ranks with ``killpg``; the rank sits in a process group of its own, so it
  gets each stop signal exactly once, forwarded by the parent (a second one would mean "stop at
  once", ``stopping.py``). A signal sent to the parent's pid alone reaches the rank the same way.
- If the parent is SIGKILLed, the kernel's parent-death signal kills the rank.

Nothing here imports torch: it runs before the rank's import does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# the signals with which torchrun (or a cluster's scheduler) stops a rank: forwarded to the rank
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
# a rank that dies of one of these could not say why: the parent does
CRASHES = {signal.SIGABRT: "aborted (SIGABRT: a C++ abort, as gloo's or NCCL's after a failed "
                           "collective; its message is above)",
           signal.SIGSEGV: "crashed (SIGSEGV)", signal.SIGBUS: "crashed (SIGBUS)",
           signal.SIGILL: "crashed (SIGILL)", signal.SIGFPE: "crashed (SIGFPE)",
           signal.SIGKILL: "was killed (SIGKILL: the kernel's out-of-memory killer, or a kill -9 "
                           "sent to it)"}
# after an abort; also the local launcher's (checking.CHECK_HINT), kept here: no torch import
HINT = ("if the dead rank said \"Received data size doesn't match expected size\", ranks fed a "
        "collective different shapes: run again with tensorpar --check-collectives CMD (in code: "
        "TENSORPAR_CHECK_COLLECTIVES=1) to have the layer and each rank's shape named")
_PR_SET_PDEATHSIG = 1


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def guard_rank(command: str) -> None:
    """Fork the rank and return in it; the parent waits and never returns (module docstring).
    ``command``: the ``tensorpar`` command, for the parent's line ("" when none is known)."""
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)  # torchrun's killpg reaches the parent only; it forwards once
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux: the rank outlives a SIGKILLed parent
            pass
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        return
    try:
        os.setpgid(child, child)  # also here: a signal forwarded at once must find the group
    except OSError:  # the rank did it first, or is gone already
        pass
    for s in FORWARDED:
        signal.signal(s, lambda signum, frame: _forward(child, signum))
    _, status = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    signum = os.WTERMSIG(status)
    if signum in CRASHES:
        rank = os.environ.get("RANK", "?")
        hint = f"; {HINT}" if signum == signal.SIGABRT else ""
        who = f"tensorpar {command}" if command else "tensorpar"
        print(f"{who}: rank {rank} (pid {child}) {CRASHES[signum]}{hint}", file=sys.stderr,
              flush=True)
    for s in FORWARDED:
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die as the rank died, for torchrun's report
    os._exit(128 + signum)  # not reached: the default action of those signals kills


def _forward(child: int, signum: int) -> None:
    try:
        os.killpg(child, signum)  # the rank and what it started (compile workers)
    except ProcessLookupError:
        pass

