"""Dropout randomness under tensor parallelism.

Two streams, as in Megatron's RNG tracker, but held by an object instead of a global:

- "replicated": the same on every rank of the TP group (different across data-parallel
  replicas). Use it where every TP rank holds the same activations (the residual stream without
  sequence parallelism): all ranks then drop the same elements and stay identical.
- "sharded": different on every rank. Use it where ranks hold different pieces (sequence shards
  under SP, attention heads inside the TP region): a shared seed would repeat one mask pattern on
  every shard.

Each stream's seed hashes (seed, purpose, step, dp rank, and the TP rank for "sharded"), see
``runtime/seeds.py``: no two ranks, steps or regions share a mask by accident. Within a step the
dropout sites draw one after another from their stream, so each site has its own mask.

``region_for(sequence_parallel)`` picks the right stream for the residual stream.
``checkpoint_contexts`` makes a recomputed forward (``torch.utils.checkpoint``) draw exactly the
masks of the first one. A mask is kept for backward as one byte per element (a bool tensor).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.runtime.groups import tp_rank
from tensorpar.runtime.seeds import derive_seed

REGIONS = ("replicated", "sharded")


def region_for(sequence_parallel: bool) -> str:
    """The stream for dropout on the residual stream: per-rank under SP, shared otherwise."""
    return "sharded" if sequence_parallel else "replicated"


class TensorParallelRNG:
    """Seeded generators for the replicated and the sharded dropout streams.

    seed: the base seed, the same on every rank. group: the TP group (its rank picks the
    sharded stream). dp_rank: this rank's data-parallel replica (0 without data parallelism).
    A trainer calls ``set_step(step)`` before each step's forward.
    """

    def __init__(self, seed: int, group: ProcessGroup | None = None, dp_rank: int = 0):
        self.group, self.dp_rank = group, dp_rank
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """A new base seed; the streams restart at step 0."""
        self.seed = seed
        self.set_step(0)

    def set_step(self, step: int) -> None:
        """Restart both streams for optimizer step ``step``."""
        self.step = step
        self.seeds = {
            "replicated": derive_seed(self.seed, "dropout-replicated", step, self.dp_rank),
            "sharded": derive_seed(self.seed, "dropout-sharded", step, self.dp_rank,
                                   tp_rank(self.group)),
        }
        self._generators: dict[tuple[str, torch.device], torch.Generator] = {}

    def generator(self, region: str, device: torch.device | str = "cpu") -> torch.Generator:
        if region not in REGIONS:
            raise ValueError(f"region={region!r}: expected one of {REGIONS}")
        device = torch.device(device)
        key = (region, device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seeds[region])
        return self._generators[key]

    def dropout(self, x: torch.Tensor, p: float, region: str, training: bool = True):
        """Inverted dropout of ``x`` with probability ``p``, masks drawn from ``region``.
        Backward keeps the bool mask only (1 byte per element)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1]")
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return torch.zeros_like(x)
        drop = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        drop.bernoulli_(p, generator=self.generator(region, x.device))
        return x.masked_fill(drop, 0.0) * (1.0 / (1.0 - p))

    def _snapshot(self) -> dict:
        return {key: g.get_state() for key, g in self._generators.items()}

    def _restore(self, snapshot: dict) -> None:
        """The generators exactly as in ``snapshot``: those made since are dropped (they
        restart from their seed when next used, as they did the first time)."""
        for key in list(self._generators):
            if key not in snapshot:
                del self._generators[key]
        for (region, device), state in snapshot.items():
            self.generator(region, device).set_state(state)

    def checkpoint_contexts(self):
        """For ``torch.utils.checkpoint(fn, ..., use_reentrant=False, context_fn=...)``: the
        forward notes where the streams stand; the recomputation in backward starts them there
        (so it draws the same masks) and puts them back where they were after."""
        saved: dict = {}

        @contextlib.contextmanager
        def forward():
            saved.update(self._snapshot())
            yield

        @contextlib.contextmanager
        def recompute():
            now = self._snapshot()
            self._restore(saved)
            try:
                yield
            finally:
                self._restore(now)

        return forward(), recompute()


class ParallelDropout(nn.Module):
    """``nn.Dropout`` drawing its masks from one stream of a :class:`TensorParallelRNG`."""

    def __init__(self, p: float, rng: TensorParallelRNG, region: str):
        super().__init__()
        if region not in REGIONS:
            raise ValueError(f"region={region!r}: expected one of {REGIONS}")
        self.p, self.rng, self.region = p, rng, region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rng.dropout(x, self.p, self.region, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"
