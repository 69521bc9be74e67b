"""Stopping a training run on request: preemption signals, caught on every rank, agreed on.

A cluster preempts a job with SIGTERM (Slurm, Kubernetes; SIGUSR1 where the job asks for a
warning signal ahead of the kill). :class:`StopRequest` turns either into a request that the
training loop reads once per step: the step in flight finishes, the loop saves a checkpoint and
leaves, so a requeued job resumes without a lost step. This is Megatron's
``--exit-signal-handler``.

The ranks must stop after the same step, but a signal reaches them at different moments (or only
some of them). :meth:`StopRequest.agreed` therefore takes the largest signal number over the
group with one all-reduce of one int32 per step, after the optimizer step: every rank learns,
after the same step, that some rank was asked to stop. At world size 1 it is a local read.

Ctrl-C (SIGINT) is not a request: it stops at once (see ``launch/local.py``). On the
launcher's side, :func:`forwarding` passes a first SIGTERM on to the ranks it spawned and turns a
second one into :class:`Interrupted`, which stops them at once like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import torch
import torch.distributed as dist
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
        self.group, self.device = group, device or torch.device("cpu")
        self.received = 0  # the first signal number caught, 0 for none
        self._previous: dict[int, object] = {}

    def _catch(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._catch)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def agreed(self) -> int:
        """The signal some rank of the group caught (the largest number), or 0: the same on every
        rank. One all-reduce of one int32 when the group has more than one rank."""
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
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, *STOP_SIGNALS):
            signal.signal(s, signal.SIG_IGN)


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

    previous = {s: signal.signal(s, forward) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
