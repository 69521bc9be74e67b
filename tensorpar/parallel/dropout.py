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
dropout sites of a stream are numbered in the order they run (0, 1, 2, ...), and site k draws its
mask from a generator seeded with the hash of (stream seed, k): each site has its own mask, and
the mask is a function of the stream seed and k alone.

That makes the masks the same eager and under ``torch.compile``: the mask is drawn by one custom
op, ``tensorpar::dropout_mask`` (seed tensor and site number in, bool mask out), which dynamo
keeps in the graph as it is, where a ``torch.Generator`` would break it. The stream seed is a
tensor updated in place by ``set_step``, so a new step does not recompile.

``region_for(sequence_parallel)`` picks the right stream for the residual stream.
``checkpoint_contexts`` makes a recomputed forward (``torch.utils.checkpoint``) draw exactly the
masks of the first one (it numbers the sites from where the first forward did). A mask is kept
for backward as one byte per element (a bool tensor).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.runtime.groups import tp_rank
from tensorpar.runtime.seeds import derive_seed

REGIONS = ("replicated", "sharded")


def _check_region(region: str) -> None:
    if region not in REGIONS:
        raise ValueError(f"region={region!r}: expected one of {REGIONS}")


def region_for(sequence_parallel: bool) -> str:
    """The stream for dropout on the residual stream: per-rank under SP, shared otherwise."""
    return "sharded" if sequence_parallel else "replicated"


@torch.library.custom_op("tensorpar::dropout_mask", mutates_args=())
def dropout_mask(shape: list[int], p: float, seed: torch.Tensor, site: int,
                 device: torch.device) -> torch.Tensor:
    """A bool tensor of ``shape`` on ``device``, True with probability ``p``, drawn from a
    generator seeded with the hash of (``seed``, an int64 scalar on the CPU, and ``site``)."""
    g = torch.Generator(device).manual_seed(derive_seed(int(seed), "dropout-site", site))
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(p, generator=g)


@dropout_mask.register_fake
def _(shape, p, seed, site, device):
    return torch.empty(shape, dtype=torch.bool, device=device)


class TensorParallelRNG:
    """Seeded dropout streams: the replicated one and the sharded one.

    seed: the base seed, the same on every rank. group: the TP group (its rank picks the
    sharded stream). dp_rank: this rank's data-parallel replica (0 without data parallelism).
    A trainer calls ``set_step(step)`` before each step's forward.
    """

    def __init__(self, seed: int, group: ProcessGroup | None = None, dp_rank: int = 0):
        self.group, self.dp_rank = group, dp_rank
        # the stream seeds as int64 scalars, updated in place: graph inputs under compile
        self._seed_tensors = {r: torch.zeros((), dtype=torch.int64) for r in REGIONS}
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
        for region, t in self._seed_tensors.items():
            t.fill_(self.seeds[region])
        self._sites = dict.fromkeys(REGIONS, 0)  # the next site's number, per stream

    def reserve(self, region: str, count: int) -> int:
        """Take the next ``count`` site numbers of stream ``region``; returns the first. A caller
        that numbers its own sites (``site=`` below) keeps the counter out of code that runs
        twice (a recomputed block) or under a compiler's checkpoint, which allows no side effect."""
        _check_region(region)
        first = self._sites[region]
        self._sites[region] = first + count
        return first

    def mask(self, shape, p: float, region: str, device: torch.device | str = "cpu",
             site: int | None = None):
        """The bool mask of ``shape`` for site ``site`` of stream ``region`` (None: the next
        site), True with probability ``p``."""
        if site is None:
            site = self.reserve(region, 1)
        _check_region(region)
        return dropout_mask(list(shape), p, self._seed_tensors[region], site,
                            torch.device(device))

    def dropout(self, x: torch.Tensor, p: float, region: str, training: bool = True,
                site: int | None = None):
        """Inverted dropout of ``x`` with probability ``p``, the mask of site ``site`` of
        ``region`` (None: the next site). Backward keeps the bool mask only (1 byte per
        element)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1]")
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return torch.zeros_like(x)
        drop = self.mask(x.shape, p, region, x.device, site)
        return x.masked_fill(drop, 0.0) * (1.0 / (1.0 - p))

    def checkpoint_contexts(self):
        """For ``torch.utils.checkpoint(fn, ..., use_reentrant=False, context_fn=...)``: the
        forward notes each stream's next site; the recomputation in backward numbers its sites
        from there (so it draws the same masks) and puts the counters back after."""
        saved: dict = {}

        @contextlib.contextmanager
        def forward():
            saved.update(self._sites)
            yield

        @contextlib.contextmanager
        def recompute():
            now = dict(self._sites)
            self._sites.update(saved)
            try:
                yield
            finally:
                self._sites.update(now)

        return forward(), recompute()


class ParallelDropout(nn.Module):
    """``nn.Dropout`` drawing its masks from one stream of a :class:`TensorParallelRNG`."""

    def __init__(self, p: float, rng: TensorParallelRNG, region: str):
        super().__init__()
        _check_region(region)
        self.p, self.rng, self.region = p, rng, region

    def forward(self, x: torch.Tensor, site: int | None = None) -> torch.Tensor:
        """site: which site of the stream this call is (None: the next one)."""
        return self.rng.dropout(x, self.p, self.region, self.training, site)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"
