"""What the benchmark runs on each rank: set a contender up, run its steps, profile it.

The runner drives the ranks one call at a time (``RankPool.run``), interleaving contenders and
pools round by round, so a contender's model and optimizer must outlive one call: each rank keeps
the step functions of the current run in ``_LIVE`` (keyed by run id, dropped by ``teardown``).
That table lives only in the benchmark's own rank processes; no library code reads it.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tensorpar.bench.contenders import CONTENDERS
from tensorpar.bench.spec import BenchSpec, StepFn, batch, dense_state
from tensorpar.plan.meter import MemoryMeter
from tensorpar.runtime.counting import CollectiveCounter

_LIVE: dict[str, dict[str, StepFn]] = {}


def _barrier() -> None:
    """Start the ranks of a pool together, so a step's time is not another rank's lateness."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def setup(run_id: str, name: str, spec: BenchSpec, warmup: int) -> dict:
    """Build contender ``name`` and run its ``warmup`` untimed steps (0 .. warmup-1).

    The last warmup step runs under a ``CollectiveCounter`` and a ``MemoryMeter``: by then AdamW
    has its state, so it is a steady-state step. Memory is reported relative to what this process
    held before the contender was built (other contenders of the same pool live here too):
    ``state_bytes`` is what the contender keeps between steps (weights, AdamW moments),
    ``peak_bytes`` the most it held at once during the step.
    """
    torch.manual_seed(spec.seed)
    with MemoryMeter() as before:
        pass
    step = CONTENDERS[name].setup(spec, dense_state(spec), None)
    losses, comm, memory = [], {}, {}
    for s in range(warmup):
        ids_BT, targets_BT = batch(spec, s)
        if s < warmup - 1:
            losses.append(step(ids_BT, targets_BT).item())
            continue
        with CollectiveCounter() as counter, MemoryMeter() as meter:
            loss = step(ids_BT, targets_BT)
        losses.append(loss.item())
        comm = {"calls": dict(counter.counts), "payload_bytes": dict(counter.bytes),
                "ring_bytes": dict(counter.ring_bytes)}
        memory = {"state_bytes": meter.entry_bytes - before.entry_bytes,
                  "peak_bytes": meter.peak_bytes - before.entry_bytes}
    _LIVE.setdefault(run_id, {})[name] = step
    return {"losses": losses, "comm": comm, "memory": memory}


def steps(run_id: str, name: str, spec: BenchSpec, first: int, count: int) -> dict:
    """Run steps first .. first+count-1 of contender ``name``; each one's loss and seconds."""
    step = _LIVE[run_id][name]
    batches = [batch(spec, s) for s in range(first, first + count)]  # made before the clock
    losses, seconds = [], []
    _barrier()
    for ids_BT, targets_BT in batches:
        t0 = time.perf_counter()
        loss = step(ids_BT, targets_BT)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"losses": losses, "seconds": seconds}


def profile(run_id: str, name: str, spec: BenchSpec, first: int, count: int,
            top: int = 15) -> dict:
    """torch.profiler over ``count`` steps of ``name``: the top ops by self CPU time and the
    time by category (see ``profiling.py``). The steps are extra ones, after the timed ones."""
    from tensorpar.bench.profiling import summarize

    # libkineto logs "USDT: ... profiler_start / profiler_stop" to stderr at its levels up to 5
    # (USDT); 6 is above them all. Read once, when this process first starts a profiler.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    step = _LIVE[run_id][name]
    batches = [batch(spec, s) for s in range(first, first + count)]
    _barrier()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for ids_BT, targets_BT in batches:
            step(ids_BT, targets_BT)
    wall_s = time.perf_counter() - t0
    return summarize(prof, wall_s, count, top)


def teardown(run_id: str) -> None:
    """Drop this run's contenders (their models and optimizer states)."""
    _LIVE.pop(run_id, None)
