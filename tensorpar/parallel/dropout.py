"""Dropout randomness under tensor parallelism.

Two streams, as in Megatron's RNG tracker, but held by an object instead of a global:

- "replicated": the same seed on every rank. Use it where every rank holds the same activations
  (the residual stream without sequence parallelism): all ranks then drop the same elements and
  stay identical.
- "sharded": a seed that differs per TP rank. Use it where ranks hold different pieces (sequence
  shards under SP, attention heads inside the TP region): a shared seed would repeat the same mask
  pattern on every shard.

``region_for(sequence_parallel)`` picks the right stream for the residual stream.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.runtime.groups import tp_rank

SHARDED_SEED_OFFSET = 2718  # as Megatron: sharded seed = seed + 2718 + tp_rank
REGIONS = ("replicated", "sharded")


def region_for(sequence_parallel: bool) -> str:
    """The stream for dropout on the residual stream: per-rank under SP, shared otherwise."""
    return "sharded" if sequence_parallel else "replicated"


class TensorParallelRNG:
    """Seeded generators for the replicated and the sharded dropout streams.

    seed: the base seed, the same on every rank. group: the TP group (its rank picks the
    sharded stream).
    """

    def __init__(self, seed: int, group: ProcessGroup | None = None):
        self.group = group
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """Restart both streams from ``seed`` (a trainer can derive it from the step)."""
        self.seeds = {"replicated": seed,
                      "sharded": seed + SHARDED_SEED_OFFSET + tp_rank(self.group)}
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
        """Inverted dropout of ``x`` with probability ``p``, masks drawn from ``region``."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1]")
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return torch.zeros_like(x)
        keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=self.generator(region, x.device))
        return x * keep / (1.0 - p)

    def state_dict(self) -> dict:
        return {f"{region}@{device}": g.get_state() for (region, device), g in
                self._generators.items()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            region, device = key.split("@")
            self.generator(region, device).set_state(value)


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
