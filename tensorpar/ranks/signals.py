"""Every signal handler tensorpar sets, in one place: stopping a training run on request, Ctrl-C,
and what the launcher, its ranks and the fork server do with each signal.

Who does what::

    python -m tensorpar     Ctrl-C held back while torch imports (``held_ctrl_c``), then
                            KeyboardInterrupt; SIGTERM unwinds like Ctrl-C (``unwinding``);
                            once the command has said how it ended, further signals are
                            ignored (``ignore_stops``)
    the launcher            passes a training run's first SIGTERM on to its ranks, a second
                            stops them at once (``forwarding``)
    the fork server         ignores SIGINT and SIGTERM (``ignoring``): a terminal sends them to
                            the whole process group, and the ranks are the launcher's to stop
    a local rank            Ctrl-C ignored, SIGTERM default, SIGXFSZ ignored (``rank_defaults``)
    a training rank         SIGTERM / SIGUSR1 caught and agreed on (``StopRequest``)

Stop requests: preemption signals, caught on every rank, agreed on.

A cluster preempts a job with SIGTERM (Slurm, Kubernetes; SIGUSR1 where the job asks for a
warning signal ahead of the kill). :class:`StopRequest` turns either into a request that the
training loop reads once per step: the step in flight finishes, the loop saves a checkpoint and
leaves, so a requeued job resumes without a lost step. This is Megatron's
``--exit-signal-handler``.

The ranks must stop after the same step, but a signal reaches them at different moments (or only
some of them). :meth:`StopRequest.agreed` therefore takes the largest signal number over the
group with one all-reduce of one int32 per step, after the optimizer step: every rank learns,
after the same step, that some rank was asked to stop. At world size 1 it is a local read.

Ctrl-C (SIGINT) is not a request: it stops at once (see ``local.py``). On the
launcher's side, :func:`forwarding` passes a first SIGTERM on to the ranks it spawned and turns a
second one into :class:`Interrupted`, which stops them at once like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a rank uses it: the launcher's start needs none
    import torch
    from torch.distributed import ProcessGroup

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Interrupted(KeyboardInterrupt):
    """Stopped by a signal other than Ctrl-C (SIGTERM, ...): ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_interrupted(signum: int, frame) -> None:
    """A signal handler that stops the program like Ctrl-C does, naming the signal."""
    raise Interrupted(signum)


class StopRequest:
    """Catches ``STOP_SIGNALS`` while active (a context manager) and remembers the first one.

    Usable only where signal handlers can be set (the main thread); elsewhere it never fires.
    """

    def __init__(self, group: ProcessGroup | None = None, device: torch.device | None = None):
        self.group, self.device = group, device or "cpu"
        self.received = 0  # the first signal number caught, 0 for none
        self._previous: dict[int, object] = {}

    def _catch(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum

    def __enter__(self) -> StopRequest:
        self._previous = _set(dict.fromkeys(STOP_SIGNALS, self._catch))
        return self

    def __exit__(self, *exc) -> None:
        _set(self._previous)
        self._previous = {}

    def agreed(self) -> int:
        """The signal some rank of the group caught (the largest number), or 0: the same on every
        rank. One all-reduce of one int32 when the group has more than one rank."""
        import torch
        import torch.distributed as dist

        if self.group is None and not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())


def ignore_stops() -> None:
    """For a command that has said how it ended (a stop or an interrupt): a Ctrl-C or SIGTERM
    that comes while the process leaves is ignored, so the user reads one line and the exit
    status stays that of the first signal. (Ignored, not handled in Python: Python resets its own
    handlers to the default action late in its finalization, and the process would then die of
    the signal.) Main thread only; elsewhere it does nothing."""
    _set(dict.fromkeys((signal.SIGINT, *STOP_SIGNALS), signal.SIG_IGN))


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def forwarding(pool, signums: tuple[int, ...]):
    """While open, the first of ``signums`` the launcher gets is passed on to the ranks
    (``pool.signal(signum)``); a second one raises :class:`Interrupted` (the launcher then stops
    them at once)."""
    if not signums or threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def forward(signum: int, frame) -> None:
        if seen:
            raise Interrupted(signum)
        seen.append(signum)
        pool.signal(signum)

    previous = _set(dict.fromkeys(signums, forward))
    try:
        yield
    finally:
        _set(previous)


def _set(handlers: dict[int, object]) -> dict[int, object]:
    """Set each signal's handler; the ones they replace. Python sets handlers in the main thread
    only: elsewhere nothing is set (and {} returned)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s, handler in handlers.items()}


@contextlib.contextmanager
def ignoring(*signums: int) -> Iterator[None]:
    """The signals ignored while the block runs (a process started in it inherits that)."""
    previous = _set(dict.fromkeys(signums, signal.SIG_IGN))
    try:
        yield
    finally:
        _set(previous)


@contextlib.contextmanager
def held_ctrl_c() -> Iterator[None]:
    """Ctrl-C held back while the block runs, then raised: for the imports of torch and of the
    library (a second or two). A KeyboardInterrupt raised inside them can abort the process (in
    a C++ extension's initialisation: "terminate called after throwing an instance of
    'pybind11::error_already_set'"), or, raised in code an import runs through ``exec``
    (dataclasses, namedtuple), make CPython 3.11 end by SIGINT although it was caught (status -2,
    not 130; see ``__main__.run``). Of 30 Ctrl-Cs pressed in the first 2.5 s of ``verify``, one
    aborted and two ended by SIGINT before this. A process whose Ctrl-C is ignored or handled
    by its own code is left alone."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed: list[int] = []
    previous = _set({signal.SIGINT: lambda signum, frame: pressed.append(signum)})
    try:
        yield
    finally:
        _set(previous)
    if pressed:
        raise KeyboardInterrupt


def unwinding() -> None:
    """From now on SIGTERM raises :class:`Interrupted` in the main thread, which unwinds like
    Ctrl-C: the command's ranks are stopped cleanly and it exits 143."""
    _set({signal.SIGTERM: raise_interrupted})


def rank_defaults() -> None:
    """A local rank's handlers: Ctrl-C ignored (the launcher's to handle: a terminal's Ctrl-C
    reaches every process of its group), SIGTERM's default action (the fork server ignores it),
    and SIGXFSZ ignored, so that a write past ``ulimit -f`` fails with OSError(EFBIG) instead of
    killing the rank (CPython ignores it already; said here so that it stays so)."""
    _set({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_DFL,
          signal.SIGXFSZ: signal.SIG_IGN})


def await_torchrun_stop(seconds: float) -> None:
    """For a torchrun rank that leaves its error to rank 0 to say: wait until torchrun stops it
    (its SIGTERM, once rank 0 has exited with the line; default action: the rank ends) or
    ``seconds`` pass. Leaving at once would make torchrun stop rank 0 before it speaks."""
    _set({signal.SIGTERM: signal.SIG_DFL})
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)  # woken early only to die of SIGTERM


def ended_quietly(code: int) -> None:
    """After the command has ended with ``code``: a Ctrl-C that comes while Python tears down
    (tenths of a second; seconds on a loaded machine) is ignored, so the status is the command's;
    after a signal's end (``code`` > 128), SIGTERM and SIGUSR1 too. Ignored, not handled in
    Python: Python resets its handlers to the default action late in its finalization."""
    _set(dict.fromkeys((signal.SIGINT, *STOP_SIGNALS) if code > 128 else (signal.SIGINT,),
                       signal.SIG_IGN))
