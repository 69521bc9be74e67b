"""Where local ranks come from: forked from a server that imported torch once.

A spawned rank is a new Python that imports torch and tensorpar before it does anything: 3-4 s
of CPU per rank, after the launcher's own 3-4 s. multiprocessing's *forkserver* imports them
once, in a fresh process that runs no torch op and starts no thread (so forking it is safe,
unlike forking a launcher whose OpenMP or gloo threads may be running), and forks every rank
from it in milliseconds. ``python -m tensorpar`` starts the server first thing, for the
commands that start ranks (:func:`start_early`), so that the server's import and the launcher's
run side by side; a ``RankPool`` made elsewhere starts it on its first rank.

What a forked rank takes from the server rather than from the launcher, and how each is made
the launcher's again: the environment (``RankPool`` hands each rank the launcher's
``os.environ``, flags like ``--timeout`` included); the working directory and ``sys.path``
(multiprocessing sets them, as for a spawned rank); signal handlers (the server ignores SIGINT
and SIGTERM, which a terminal or a scheduler sends to the whole process group, so that the
ranks are stopped by their launcher as before; each rank sets its own, ``launch._worker``). A
rank exits when its launcher dies (``exit_with_launcher``); the server once the launcher
and every rank are gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import threading
import time

from tensorpar.ranks.signals import ignoring
from tensorpar.runtime.torchrun import under_torchrun

# what the server imports before it forks any rank: the rank's entry point, which brings torch
PRELOAD = ["tensorpar.ranks.local"]
# modules a command's ranks run, imported by the server too (a name that fails is skipped).
# Training ranks also import torch._dynamo (torch.optim's Optimizer does, 2-3 s) and rank 0 draws
# loss.png (matplotlib's Agg backend, 0.7 s): once in the server, not in every rank.
_TRAINING = ["torch._dynamo", "matplotlib.backends.backend_agg"]
COMMAND_MODULES = {
    "train": ["tensorpar.train.run", *_TRAINING],
    "generate": ["tensorpar.gpt.generate", "tensorpar.cli.generate"],
    "verify": ["tensorpar.cli.verify", "tensorpar.cli.verify_hf"],
    "bench": ["tensorpar.bench.ranks", *_TRAINING],
}
# and with --hf PATH: transformers' model and generation code (4 s), the HF trainer
HF_MODULES = ["transformers.modeling_utils", "transformers.generation", "tensorpar.train.hf_recipe"]
# and with --compile: what torch.compile's first call imports besides torch._dynamo (AOT
# autograd, its partitioner, inductor's graph code, even for aot_eager): 1 s of CPU a rank
COMPILE_MODULES = ["functorch.compile", "torch._inductor.compile_fx"]


def rank_context(preload: list[str] | tuple[str, ...] = ()) -> mp.context.BaseContext:
    """The multiprocessing context local ranks start from. ``preload``: modules for the server
    to import besides ``PRELOAD`` (when it starts; one server serves the whole process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def start_server(preload: list[str] | tuple[str, ...] = ()) -> mp.context.BaseContext:
    """Start the server unless it runs already, return at once (it imports while the caller
    goes on) with the context ranks start from. SIGINT and SIGTERM are ignored in the server
    (set here, inherited through its exec), however it was started."""
    from multiprocessing import forkserver

    ctx = rank_context(preload)
    with ignoring(signal.SIGINT, signal.SIGTERM):
        forkserver.ensure_running()
    return ctx


def start_early(argv: list[str]) -> None:
    """For ``python -m tensorpar ARGV``: start the server before the launcher imports torch, if
    the command starts local ranks (not under torchrun, whose processes are the ranks; not for
    ``--help``). A word of ARGV is taken for the command: at worst the server starts for
    nothing."""
    if under_torchrun() or {"-h", "--help"} & set(argv):
        return
    command = next((word for word in argv if word in COMMAND_MODULES), None)
    if command is not None:
        start_server(preload_for(command, argv))


def preload_for(command: str, argv: list[str]) -> list[str]:
    """What the server imports for ``command``'s ranks, given the command line's words."""
    return (COMMAND_MODULES[command] + (HF_MODULES if "--hf" in argv else [])
            + (COMPILE_MODULES if "--compile" in argv else []))


def exit_with_launcher(launcher: int) -> None:
    """Make this rank exit when its launcher dies (``kill PID``), watched by a thread: on a
    pidfd of the launcher (Linux), else by polling. (Not the kernel's parent-death signal: the
    parent is the fork server, which outlives the launcher while any rank lives: above.)"""
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:  # gone already
        os._exit(1)
    except (AttributeError, OSError):  # not Linux: poll
        fd = None

    def watch():
        if fd is not None:
            select.select([fd], [], [])  # readable once the launcher has exited
        else:
            while _alive(launcher):
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-launcher").start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
