"""What the trainer measures of one steady step, outside the loop: the collectives it makes
(``CollectiveCounter``, per group) and its peak tensor memory (``MemoryMeter``), for the
summary to set beside the planner's prediction.

The step measured is the run's second (under DDP its third: DDP rebuilds its gradient buckets
after the first step, broadcasting), once AdamW's states exist; a run of one step measures
that one. Every other step runs without the counters, which are TorchDispatchModes: a
compiled step run under one would run eagerly (``compute.loss_function``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tensorpar.planner.meter import MemoryMeter
from tensorpar.runtime.counting import CollectiveCounter

KINDS = ("counts", "bytes", "ring_bytes")


class StepMeasure:
    """``with measure.around(step): ...`` measures the block when ``step`` is the one chosen.

    groups: the groups whose collectives are counted, by name ("tp", "dp" under data
    parallelism, "pp" with pipeline stages, "ep" and "stats" with MoE blocks, "cp" under
    context parallelism). After the measured step, ``comm`` holds the "tp" group's counts, bytes
    and ring bytes (``comm["dp"]`` the dp group's, ``comm["pp"]`` the pipeline's sends and
    receives, ``comm["ep"]`` and ``comm["stats"]`` the MoE blocks', ``comm["cp"]`` the K/V
    gathers), ``peak_memory`` the peak in bytes."""

    def __init__(self, start: int, steps: int, groups: dict, device: torch.device,
                 ddp: bool = False):
        settle = 2 if ddp else 1
        self.step = start + min(settle, max(0, steps - start - 1))
        self.groups, self.device = groups, device
        self.comm: dict = {k: {} for k in KINDS}
        self.peak_memory: int | None = None

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.step:
            yield
            return
        counter, meter = CollectiveCounter(self.groups), MemoryMeter(self.device)
        with counter, meter:
            yield
        tp = counter.by_group.get("tp", {})
        self.comm = {k: dict(tp.get(k, {})) for k in KINDS}
        for label in ("dp", "pp", "ep", "stats", "cp"):
            if label in self.groups:
                self.comm[label] = {k: dict(v)
                                    for k, v in counter.by_group.get(label, {}).items()}
        self.peak_memory = meter.peak_bytes


def resident_peak() -> int | None:
    """This process's peak resident memory in bytes (None where the OS does not say): what a
    rank held at most, memory-mapped token shards' pages read included."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux: KiB
