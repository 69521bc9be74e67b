"""What the benchmark runs on each rank: set a contender up, run its steps, profile it.

The runner drives the ranks one call at a time (``RankPool.run``), interleaving contenders and
pools round by round, so a contender's model and optimizer must outlive one call: each rank keeps
the step functions of the current run in ``_LIVE`` (keyed by run id, dropped by ``teardown``).
That table lives only in the benchmark's own rank processes; no library code reads it.
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from tensorpar.bench.contenders import CONTENDERS
from tensorpar.bench.workload import StepFn, Workload, batch, dense_state
from tensorpar.planner.meter import MemoryMeter
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import device_for

_LIVE: dict[str, dict[str, StepFn]] = {}


def _barrier() -> None:
    """Start the ranks of a pool together, so a step's time is not another rank's lateness."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a step's time is its own (on the CPU: nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _on(device: torch.device, ids_BT: torch.Tensor, targets_BT: torch.Tensor):
    return ids_BT.to(device), targets_BT.to(device)


def setup(run_id: str, name: str, work: Workload, warmup: int,
          compile_backend: str = "inductor") -> dict:
    """Build contender ``name`` and run its ``warmup`` untimed steps (0 .. warmup-1), on this
    rank's device (``device_for``: the CPU, or a GPU in a pool on NCCL).

    The last warmup step runs under a ``CollectiveCounter`` and a ``MemoryMeter``: by then AdamW
    has its state, so it is a steady-state step. Memory is reported relative to what this process
    held before the contender was built (other contenders of the same pool live here too):
    ``state_bytes`` is what the contender keeps between steps (weights, AdamW moments),
    ``peak_bytes`` the most it held at once during the step.

    A compiled contender counts its collectives one step earlier: the counter is a
    TorchDispatchMode, under which the step runs the model eagerly (dynamo compiles nothing
    under one, ``train/compute.loss_function``), so that its last warmup step runs compiled. A
    GPU's meter reads the allocator's statistics: the memory is the compiled step's. On the CPU
    the meter is a TorchDispatchMode too, so a compiled contender's is read off the profiler's
    allocator events instead (``MemoryMeter(profiled=True)``, which runs no such mode; at TP > 1
    it may read high by the overlapped all-reduces' buffers, one activation at most each).
    ``memory["meter"]`` says which: "allocator" (GPU), "dispatch" or "profiler" (CPU).
    """
    torch.manual_seed(work.seed)
    device = device_for()
    with MemoryMeter(device) as before:
        pass
    c = CONTENDERS[name]
    state = dense_state(work)
    n_params = sum(t.numel() for t in state.values())
    kwargs = {"compile_backend": compile_backend} if c.compiled else {}
    step = c.setup(work, state, None, device, **kwargs)
    del state  # the contender keeps its own copy (or its shard) only
    counted_step = warmup - 2 if c.compiled else warmup - 1
    profiled = c.compiled and device.type == "cpu"
    if profiled:
        _quiet_profiler()
    losses, comm, memory = [], {}, {}
    for s in range(warmup):
        ids_BT, targets_BT = _on(device, *batch(work, s))
        counter = CollectiveCounter() if s == counted_step else None
        meter = MemoryMeter(device, profiled=profiled) if s == warmup - 1 else None
        with counter or nullcontext(), meter or nullcontext():
            losses.append(step(ids_BT, targets_BT).item())
        if counter is not None:
            comm = {"calls": dict(counter.counts), "payload_bytes": dict(counter.bytes),
                    "ring_bytes": dict(counter.ring_bytes)}
        if meter is not None:
            memory = {"state_bytes": meter.entry_bytes - before.entry_bytes,
                      "peak_bytes": meter.peak_bytes - before.entry_bytes,
                      "meter": "allocator" if device.type == "cuda" else
                      "profiler" if profiled else "dispatch"}
    _LIVE.setdefault(run_id, {})[name] = step
    return {"losses": losses, "comm": comm, "memory": memory, "device": str(device),
            "n_params": n_params}


def steps(run_id: str, name: str, work: Workload, first: int, count: int) -> dict:
    """Run steps first .. first+count-1 of contender ``name``; each one's loss and seconds."""
    step, device = _LIVE[run_id][name], device_for()
    batches = [_on(device, *batch(work, s)) for s in range(first, first + count)]  # made first
    losses, seconds = [], []
    _sync(device)
    _barrier()
    for ids_BT, targets_BT in batches:
        t0 = time.perf_counter()
        loss = step(ids_BT, targets_BT)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"losses": losses, "seconds": seconds}


def matmul_peak(n: int = 8192, rounds: int = 5, per_round: int = 10) -> float:
    """FLOP/s of bf16 (n, n) @ (n, n) products on this rank's GPU, the best of ``rounds`` rounds
    of ``per_round`` back-to-back products: the peak MFU is quoted against, measured rather than
    read off a data sheet (whose clocks this GPU may not hold)."""
    device = device_for()
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):  # the first products pick kernels and raise the clocks
        a @ b
    best = float("inf")
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(per_round):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / per_round)
    return 2 * n**3 / best


def profile(run_id: str, name: str, work: Workload, first: int, count: int,
            top: int = 15) -> dict:
    """torch.profiler over ``count`` steps of ``name``: the top ops by self CPU time and the
    time by category (see ``profiling.py``). The steps are extra ones, after the timed ones."""
    from tensorpar.bench.profiling import summarize

    _quiet_profiler()
    step, device = _LIVE[run_id][name], device_for()
    batches = [_on(device, *batch(work, s)) for s in range(first, first + count)]
    _sync(device)
    _barrier()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for ids_BT, targets_BT in batches:
            step(ids_BT, targets_BT)
        _sync(device)
    wall_s = time.perf_counter() - t0
    return summarize(prof, wall_s, count, top)


def _quiet_profiler() -> None:
    """libkineto logs "USDT: ... profiler_start / profiler_stop" to stderr at its levels up to 5
    (USDT); 6 is above them all. Read once, when this process first starts a profiler."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def teardown(run_id: str) -> None:
    """Drop this run's contenders (their models and optimizer states) and torch.compile's
    caches, whose compiled frames hold the compiled models, so the process keeps nothing."""
    import torch._dynamo

    if any(CONTENDERS[name].compiled for name in _LIVE.pop(run_id, {})):
        torch._dynamo.reset()
    gc.collect()
