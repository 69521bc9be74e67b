"""Spawn N local ranks and run functions on all of them.

``RankPool(n)`` starts n processes once, each with torch.distributed initialized through
:func:`tensorpar.init_tensor_parallel` (the same environment torchrun would set), and then runs
any number of functions on every rank: ``pool.run(fn, *args)`` returns the list of per-rank return
values. The CLI runs one job through it; the tests keep one pool per world size for the session.

Failure handling, so that nothing hangs:
- a function that raises on a rank comes back as :class:`RankError` with that rank's traceback
  and what it was (``failures``: an expected error in one line, or a bug; ``failures.py``);
- if some ranks raised and the others are stuck in a collective waiting for them, the pool waits
  ``grace_s`` seconds (10, or the collective timeout when shorter: by then a collective
  already waiting for the failed rank has failed and said so), then stops every rank and is
  closed (a later ``run`` raises);
- a rank that dies (segfault, abort) or a job past ``timeout_s`` also stops the whole pool; the
  error names the rank and the signal; an abort (gloo's answer to ranks that fed a collective
  different shapes; its message is on the launcher's stderr) comes with the hint to turn the
  check mode on (``checking.py``), which makes that an error on every rank;
- ranks exit when the process that started them dies (``kill PID``): none is left behind.

Signals: the ranks ignore Ctrl-C (SIGINT); the launcher takes it (``KeyboardInterrupt``) and
stops them, so a terminal's Ctrl-C, which reaches every process, ends with no per-rank
traceback. ``launch(..., forward_signals=...)`` passes the first such signal (a training run's
SIGTERM) on to the ranks and lets them finish; a second signal, or Ctrl-C, stops them at once.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp

from tensorpar.ranks.checking import CHECK_HINT
from tensorpar.ranks.failures import EXPECTED, RankError, RankFailure, collective_failure
from tensorpar.ranks.forkserver import exit_with_launcher, start_server
from tensorpar.ranks.signals import forwarding, ignoring, rank_defaults, signal_name
from tensorpar.runtime.groups import (
    DEVICE_ENV,
    check_device,
    checks_wanted,
    collective_timeout_s,
    collectives_checked,
)
from tensorpar.runtime.torchrun import under_torchrun

PORT_TRIES = 3  # starts of a pool's ranks, each on a new port, when its port was taken
GRACE_S = 10.0  # the longest a pool waits for the other ranks once one has failed


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str | None, threads: int, all_tasks,
            results, launcher: int, env: dict[str, str], check_collectives: bool | None,
            device: str | None):
    """One local rank: its process group, then every job of ``all_tasks[rank]`` until None."""
    tasks = all_tasks[rank]
    exit_with_launcher(launcher)
    rank_defaults()
    os.environ.clear()  # the launcher's environment, not the fork server's (forkserver.py)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    if device is not None:  # read by device_for(), as under ``tensorpar --device`` (groups.py)
        os.environ[DEVICE_ENV] = device
    # imported here, in the child, after its rank's environment is set
    import torch

    from tensorpar.runtime.groups import init_tensor_parallel

    torch.set_num_threads(threads)
    try:
        init_tensor_parallel(backend=backend, check_collectives=check_collectives)
    except BaseException as e:
        results.put((rank, False, RankFailure.of(rank, e)))
        return
    _freeze_imports()
    results.put((rank, True, "ready"))
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            results.put((rank, True, _sendable(fn(*args, **kwargs), fn)))
        except BaseException as e:
            results.put((rank, False, RankFailure.of(rank, e)))
    _shut_down()


def _sendable(value: Any, fn: Callable) -> Any:
    """``value``, once it is known to pickle: the queue pickles it in a thread of its own, where
    an error (a tensor still part of an autograd graph: "Cowardly refusing to serialize non-leaf
    tensor") would never reach the launcher, which would wait for the result forever."""
    try:
        ForkingPickler.dumps(value)
    except Exception as e:
        raise TypeError(f"{getattr(fn, '__name__', fn)} returned a value that cannot be sent back "
                        f"to the launcher ({type(e).__name__}: {e}); return plain values, or "
                        "tensors detached from autograd (.detach())") from e
    return value


def _freeze_imports() -> None:
    """Exempt what a rank holds when it starts (torch and the command's modules, from the fork
    server: about 390,000 objects with transformers) from later garbage collections
    (``gc.freeze``): each full collection walked them, 0.25-0.5 s here, paid by every
    ``MemoryMeter`` pass and by Python's own collections (a pause the other ranks wait out: the
    stall Megatron's ``--manual-gc`` addresses). The plan and HF-training tests took 67 s in
    place of 121; the bench's step did not change. Only in processes tensorpar owns: these ranks
    and ``python -m tensorpar`` (which is the rank under torchrun), not a user's own process.
    ``MemoryMeter`` scans ``gc.get_objects()``, which leaves frozen objects out: a rank holds
    no tensor yet when it freezes."""
    gc.freeze()


def _shut_down() -> None:
    """Destroy the process groups, then free what only reference cycles still hold (autograd
    graphs keep a group and gloo's finished work): a group freed later, by the collection at
    interpreter exit, has gloo worker threads that need the GIL and abort the process
    ("terminate called without an active exception", seen 1 run in 7 under torchrun)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()


class RankPool:
    """n spawned local ranks with torch.distributed initialized, reused across ``run`` calls.

    nprocs: number of ranks.
    backend: "gloo" or "nccl"; default: NCCL when every rank can have a GPU (and no ``device``
        is asked for), else gloo.
    threads: torch threads per rank; default: the machine's cores divided among the ranks.
    timeout_s: longest one ``run`` may take before the pool is stopped (None: no limit).
    grace_s: how long to wait for the other ranks once one has failed; default ``GRACE_S``,
        or the ranks' collective timeout (``tensorpar --timeout``) when that is shorter: a rank
        already waiting in a collective for the failed one has given up by then (one that
        enters a collective later may still be waiting, and is stopped).
    check_collectives: compare each collective across ranks first (``checking.py``); default
        ``TENSORPAR_CHECK_COLLECTIVES`` from the environment.
    device: "cpu", or "cuda": every rank on a GPU over gloo, n ranks on one GPU too (a test mode,
        ``groups.py``); default ``TENSORPAR_DEVICE``, else as ``backend`` (NCCL: GPUs).
    """

    def __init__(self, nprocs: int, backend: str | None = None, threads: int | None = None,
                 timeout_s: float | None = 600.0, grace_s: float | None = None,
                 check_collectives: bool | None = None, device: str | None = None):
        if nprocs < 1:
            raise ValueError(f"nprocs={nprocs} must be >= 1")
        check_device(device)  # before any rank is spawned; the environment's, in each rank
        self.nprocs, self.timeout_s = nprocs, timeout_s
        self.grace_s = min(GRACE_S, collective_timeout_s()) if grace_s is None else grace_s
        self.checked = (checks_wanted(check_collectives)
                        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")
        threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        # the port is free when found, and bound by rank 0's store a moment later: another
        # process may take it in between, so the ranks start again on another port then
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._start(nprocs, free_port(), (backend, threads), check_collectives, device)
                break
            except RankError as e:
                if attempt == PORT_TRIES or "EADDRINUSE" not in str(e):
                    raise

    def _start(self, nprocs: int, port: int, how: tuple, check_collectives, device) -> None:
        """Start the ranks on ``port`` (``how``: backend, threads) and wait until every one is
        ready; closed again if they fail to."""
        ctx = start_server()  # a no-op once it runs (python -m tensorpar starts it early)
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(nprocs)]
        args = (nprocs, port, *how, self._tasks, self._results, os.getpid(),
                dict(os.environ), check_collectives, device)
        # torch's own start (the forkserver's processes, as mp.spawn's); Ctrl-C ignored while
        # they start (inherited): one while a rank imports is the launcher's to handle
        with ignoring(signal.SIGINT):
            self._context = mp.start_processes(_worker, args, nprocs, join=False, daemon=True,
                                               start_method="forkserver")
        self._procs = self._context.processes
        self._closed = self._stop_asked = False
        try:  # every rank reports "ready" once its process group is up
            self._collect(self.timeout_s)
        except BaseException:  # Ctrl-C while ranks start: no ``with`` closes the pool, and a
            self.close(force=True)  # rank left unpickling its arguments prints a traceback
            raise

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self._closed:
            raise RuntimeError("this RankPool is closed (a rank failed or it was shut down)")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(self.timeout_s)

    def _collect(self, timeout_s: float | None) -> list[Any]:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + (float("inf") if timeout_s is None else timeout_s)
        while len(got) < self.nprocs:
            failed = any(not ok for ok, _ in got.values())
            if failed:
                deadline = min(deadline, time.monotonic() + self.grace_s)
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() > deadline:
                self.close(force=True)
                codes = [self._procs[r].exitcode for r in dead]
                why = (f"rank(s) {dead} died (exit codes {codes}){_how(codes)}" if dead else
                       f"ranks {sorted(set(range(self.nprocs)) - set(got))} did not finish")
                aborted = -signal.SIGABRT in codes and not self.checked
                raise _rank_error(got, why, died=bool(dead), hint=CHECK_HINT if aborted else None)
        if any(not ok for ok, _ in got.values()):
            raise _rank_error(got, None)
        return [got[r][1] for r in range(self.nprocs)]

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every rank still running."""
        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def ask_to_stop(self) -> None:
        """Tell every rank to stop after its job, without waiting: pools then close side by side."""
        if not self._stop_asked:
            self._stop_asked = True
            for q in self._tasks:
                q.put(None)

    def close(self, force: bool = False) -> None:
        """Stop every rank: politely (destroy the process group) unless ``force``."""
        if self._closed:
            return
        self._closed = True
        if not force:
            self.ask_to_stop()
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:  # every rank, then wait: a rank that outlived another by the
            if p.is_alive():  # time a join takes could report the lost peer (gloo's log line)
                p.kill()
        for p in self._procs:
            p.join(timeout=10)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(force=exc_type is not None)  # interrupted (Ctrl-C): do not wait for the ranks


def _how(codes: list[int | None]) -> str:
    """``: SIGKILL`` for exit codes [-9]; an abort says where its message is."""
    names = sorted({signal_name(-c) for c in codes if c is not None and c < 0})
    aborted = " (an abort; its message, gloo's or NCCL's, is above)" * (-signal.SIGABRT in codes)
    return ": " + ", ".join(names) + aborted if names else ""


def _rank_error(got: dict[int, tuple[bool, Any]], why: str | None, died: bool = False,
                hint: str | None = None):
    """The pool's reason, if any, then each failing rank's traceback under a ``--- rank R
    failed:`` line; the failures themselves ride along (see failures.py)."""
    failures = [got[r][1] for r in sorted(got) if not got[r][0]]
    lines = [why] if why else []
    lines += [f"--- rank {f.rank} failed:\n{f.traceback.rstrip()}" for f in failures]
    lines += [hint] if hint else []
    return RankError("\n".join(lines), failures, why, died, hint)


def run_ranks(fn: Callable[..., Any], nprocs: int, *args: Any,
              forward_signals: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(*args, group=...)`` on ``nprocs`` ranks: spawn them, or, under torchrun, be one of
    them. Every rank's result in rank order (under torchrun, on every rank: each ends alike).
    ``forward_signals``: see :func:`launch` (torchrun passes its signals on by itself)."""
    if not under_torchrun():
        return launch(fn, nprocs, *args, forward_signals=forward_signals)
    import torch.distributed as dist

    from tensorpar.runtime.groups import init_tensor_parallel, tp_rank, tp_size

    group = init_tensor_parallel(nprocs)
    try:
        try:
            result = fn(*args, group=group)
        except EXPECTED as e:  # this rank's own expected error: it says so itself (cli.main)
            e.rank = tp_rank(group)
            raise
        except RuntimeError as e:  # ranks that disagree (the check), or a rank lost: expected
            hint = None if collectives_checked(group) else CHECK_HINT
            if (said := collective_failure(e, hint)) is None:
                raise
            said.rank = tp_rank(group)
            raise said from e
        results = [None] * tp_size(group)
        dist.all_gather_object(results, result, group=group)
        return results
    finally:
        _shut_down()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float | None = None,
           forward_signals: tuple[int, ...] = (), check_collectives: bool | None = None,
           **kwargs: Any) -> list[Any]:
    """Spawn ``nprocs`` ranks, run ``fn(*args, **kwargs)`` on each, shut down; per-rank results.
    timeout_s: the longest the job may run (None: no limit, as for a training run).
    forward_signals: signals passed on to the ranks once (the ranks handle them), see above.
    check_collectives: see :class:`RankPool`."""
    with (RankPool(nprocs, timeout_s=timeout_s, check_collectives=check_collectives) as pool,
          forwarding(pool, forward_signals)):
        return pool.run(fn, *args, **kwargs)
