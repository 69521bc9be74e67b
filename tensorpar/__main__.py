"""``python -m tensorpar`` and the ``tensorpar`` command: what runs before the command line is
parsed (and before torch is imported), then ``cli.main``."""

import faulthandler
import gc
import os
import sys

from tensorpar.ranks.forkserver import COMMAND_MODULES, start_early
from tensorpar.ranks.signals import ended_quietly, held_ctrl_c
from tensorpar.runtime.torchrun import under_torchrun


def run() -> None:
    argv = sys.argv[1:]
    command = next((w for w in argv if w in COMMAND_MODULES), "")
    if under_torchrun():
        # a rank that crashes (SIGSEGV) or aborts (SIGABRT: gloo's C++ terminate after ranks
        # fed a collective different shapes) prints its Python stack; torchrun's report then
        # names the rank and the signal
        faulthandler.enable(all_threads=True)
    try:
        with held_ctrl_c():
            start_early(argv)  # the ranks' fork server imports torch while this process does too
            from tensorpar.cli.main import main
        # the imports live as long as the process: no collection walks them again (as in the
        # ranks, ranks/local.py); ``verify --tp 2`` takes 2.5-3.0 s here in place of 3.1
        gc.freeze()
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling (importing torch)
        who = f"tensorpar {command}" if command else "tensorpar"
        print(f"{who}: interrupted (Ctrl-C)", file=sys.stderr)
        code = 130
    # the command has ended and said how: a signal from now on changes nothing
    ended_quietly(code)
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


if __name__ == "__main__":
    run()
