"""``python -m tensorpar`` and the ``tensorpar`` command: what runs before the command line is
parsed (and before torch is imported), then ``cli.main``."""

import os
import signal
import sys

from tensorpar.runtime.forking import COMMAND_MODULES, start_early
from tensorpar.runtime.rank_guard import guard_rank, under_torchrun


def run() -> None:
    argv = sys.argv[1:]
    command = next((w for w in argv if w in COMMAND_MODULES), "")
    if under_torchrun():  # a parent that reports the rank's abort (runtime/rank_guard.py)
        guard_rank(command)
    try:
        start_early(argv)  # the ranks' fork server imports torch while this process does too
        from tensorpar.cli import main

        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling (importing torch)
        who = f"tensorpar {command}" if command else "tensorpar"
        print(f"{who}: interrupted (Ctrl-C)", file=sys.stderr)
        code = 130
    if code == 130:
        # Interrupted, and said so: a Ctrl-C pressed again while Python tears down (seconds on a
        # loaded machine) is ignored. A Python handler would not do: Python resets it to the
        # default action late in its finalization, and the process would die of the signal
        # (status -2, not 130). SIGTERM still ends it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if under_torchrun():
        # Under torchrun the process group is already destroyed here; leave without the
        # interpreter's teardown, in which gloo's threads now and then abort the process
        # ("terminate called without an active exception") after a run that succeeded.
        # Everything is written and closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
