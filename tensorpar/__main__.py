"""``python -m tensorpar`` and the ``tensorpar`` command: what runs before the command line is
parsed (and before torch is imported), then ``cli.main``."""

import contextlib
import gc
import os
import signal
import sys
import threading

from tensorpar.ranks.forkserver import COMMAND_MODULES, start_early
from tensorpar.ranks.rank_guard import guard_rank, under_torchrun


def run() -> None:
    argv = sys.argv[1:]
    command = next((w for w in argv if w in COMMAND_MODULES), "")
    if under_torchrun():  # a parent that reports the rank's abort (launch/rank_guard.py)
        guard_rank(command)
    try:
        with _ctrl_c_held():
            start_early(argv)  # the ranks' fork server imports torch while this process does too
            from tensorpar.cli.main import main
        # the imports live as long as the process: no collection walks them again (as in the
        # ranks, launch.py); ``verify --tp 2`` takes 2.5-3.0 s here in place of 3.1
        gc.freeze()
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling (importing torch)
        who = f"tensorpar {command}" if command else "tensorpar"
        print(f"{who}: interrupted (Ctrl-C)", file=sys.stderr)
        code = 130
    # The command has ended and said how: a Ctrl-C that comes while Python tears down (tenths of
    # a second; seconds on a loaded machine) is ignored, so the status is the command's (a run
    # that had finished as Ctrl-C was pressed ended 0, or by SIGINT within Python's finalization:
    # 1 of 7 presses at the end of a ``verify``); after a signal's end, SIGTERM and SIGUSR1
    # too (cli.main's commands ignore them from the moment they speak). A Python handler would
    # not do: Python resets it to the default action late in its finalization.
    ends = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) if code > 128 else (signal.SIGINT,)
    for s in ends:
        signal.signal(s, signal.SIG_IGN)
    if code == 130:
        # CPython (3.11 here) marks a KeyboardInterrupt that passed through code run from a
        # string (the exec of namedtuple and dataclasses, as a module imports) as unhandled even
        # once caught, and then ends a ``python -m`` run by SIGINT (status -2) in place of 130:
        # measured 6 of 25 Ctrl-Cs pressed 1.1-1.6 s into ``verify``. Running a string clears
        # the mark.
        exec("")
    if under_torchrun():
        # Under torchrun the process group is already destroyed here; leave without the
        # interpreter's teardown, in which gloo's threads now and then abort the process
        # ("terminate called without an active exception") after a run that succeeded.
        # Everything is written and closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


@contextlib.contextmanager
def _ctrl_c_held():
    """Ctrl-C held back while the block runs, then raised: for the imports of torch and of the
    library (a second or two). A KeyboardInterrupt raised inside them can abort the process (in
    a C++ extension's initialisation: "terminate called after throwing an instance of
    'pybind11::error_already_set'"), or, raised in code an import runs through ``exec``
    (dataclasses, namedtuple), make CPython 3.11 end by SIGINT although it was caught (status -2,
    not 130; see ``run``). Of 30 Ctrl-Cs pressed in the first 2.5 s of ``verify``, one aborted
    and two ended by SIGINT before this."""
    if (signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # ignored, or a
            or threading.current_thread() is not threading.main_thread()):  # caller's own
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


if __name__ == "__main__":
    run()
