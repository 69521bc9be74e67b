"""Dropout randomness under tensor parallelism.

Two streams, as in Megatron's RNG tracker, but held by an object instead of a global:

- "replicated": the same on every rank of the TP group (different across data-parallel
  replicas). Use it where every TP rank holds the same activations (the residual stream without
  sequence parallelism): all ranks then drop the same elements and stay identical.
- "sharded": different on every rank. Use it where ranks hold different pieces (sequence shards
  under SP, attention heads inside the TP region): a shared seed would repeat one mask pattern on
  every shard.

Each stream's seed hashes (seed, purpose, step, dp rank, and the TP rank for "sharded"), see
``runtime/seeds.py``: no two ranks, steps or regions share a mask by accident. Within a step a
stream hands out keys, (stream seed, c) for its c-th key since ``set_step``, and a mask is drawn
for a (key, site) pair from a generator seeded with the hash of (stream seed, c, site): a
dropout call without a key takes a new key (its own mask); the GPT takes one key per block and
numbers the block's two sites 0 and 1.

A key is a tensor (int64 [2]) and the mask is drawn by one custom op, ``tensorpar::dropout_mask``
(key and site in, bool mask out), so ``torch.compile`` keeps dropout in its graph (a
``torch.Generator`` would break it), reads no Python counter (nothing to guard: a new step or
another forward does not recompile) and draws eager's masks. A block recomputed by
``torch.utils.checkpoint`` is handed its key again, so it draws the masks of its first forward,
eager or compiled; ``checkpoint_contexts`` does the same for code that takes keys as it runs.

``region_for(sequence_parallel)`` picks the right stream for the residual stream. A mask is kept
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
def dropout_mask(shape: list[int], p: float, key: torch.Tensor, site: int,
                 device: torch.device) -> torch.Tensor:
    """A bool tensor of ``shape`` on ``device``, True with probability ``p``, drawn from a
    generator seeded with the hash of (``key``: int64 [stream seed, key number] on the CPU,
    ``site``)."""
    seed, number = key.tolist()
    g = torch.Generator(device).manual_seed(derive_seed(seed, "dropout-site", number, site))
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(p, generator=g)


@dropout_mask.register_fake
def _(shape, p, key, site, device):
    return torch.empty(shape, dtype=torch.bool, device=device)


class TensorParallelRNG:
    """Seeded dropout streams: the replicated one and the sharded one.

    seed: the base seed, the same on every rank. group: the TP group (its rank picks the
    sharded stream). dp_rank: this rank's data-parallel replica (0 without data parallelism).
    cp_rank: this rank's place in a context-parallel group (None without CP): one more
    coordinate of both streams, since the CP ranks hold different tokens of a sequence (no two
    share a mask); without CP the streams are what they were.
    A trainer calls ``set_step(step)`` before each step's forward.
    """

    def __init__(self, seed: int, group: ProcessGroup | None = None, dp_rank: int = 0,
                 cp_rank: int | None = None):
        self.group, self.dp_rank = group, dp_rank
        self.cp = () if cp_rank is None else (cp_rank,)
        # per stream, as int64 scalars updated in place (graph inputs under compile): its seed,
        # and how many keys it has handed out since set_step
        self._seed_tensors = {r: torch.zeros((), dtype=torch.int64) for r in REGIONS}
        self._keys_out = {r: torch.zeros((), dtype=torch.int64) for r in REGIONS}
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """A new base seed; the streams restart at step 0."""
        self.seed = seed
        self.set_step(0)

    def set_step(self, step: int) -> None:
        """Restart both streams for optimizer step ``step``."""
        self.step = step
        self.seeds = {
            "replicated": derive_seed(self.seed, "dropout-replicated", step, self.dp_rank,
                                      *self.cp),
            "sharded": derive_seed(self.seed, "dropout-sharded", step, self.dp_rank,
                                   tp_rank(self.group), *self.cp),
        }
        for region in REGIONS:
            self._seed_tensors[region].fill_(self.seeds[region])
            self._keys_out[region].zero_()

    def key(self, region: str) -> torch.Tensor:
        """The next key of stream ``region``: int64 [stream seed, key number]. Each of its sites
        (0, 1, ...) has a mask of its own."""
        _check_region(region)
        number = self._keys_out[region]
        number.add_(1)
        return torch.stack((self._seed_tensors[region], number))

    def key_at(self, region: str, number: int) -> torch.Tensor:
        """Key ``number`` of stream ``region`` this step, as ``key`` hands it out as its
        ``number``-th (the counter untouched): for code that knows which key it needs (a pipeline
        stage's blocks: ``gpt/stages.py``)."""
        _check_region(region)
        return torch.stack((self._seed_tensors[region], torch.tensor(number)))

    def mask(self, shape, p: float, region: str, device: torch.device | str = "cpu",
             key: torch.Tensor | None = None, site: int = 0):
        """The bool mask of ``shape`` for (``key``, ``site``) of stream ``region`` (key None: a
        new key), True with probability ``p``."""
        _check_region(region)
        if key is None:
            key = self.key(region)
        return dropout_mask(list(shape), p, key, site, torch.device(device))

    def dropout(self, x: torch.Tensor, p: float, region: str, training: bool = True,
                key: torch.Tensor | None = None, site: int = 0):
        """Inverted dropout of ``x`` with probability ``p``, the mask of (``key``, ``site``) of
        ``region`` (key None: a new key). Backward keeps the bool mask only (1 byte per
        element)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1]")
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return torch.zeros_like(x)
        drop = self.mask(x.shape, p, region, x.device, key, site)
        return x.masked_fill(drop, 0.0) * (1.0 / (1.0 - p))

    def checkpoint_contexts(self):
        """For ``torch.utils.checkpoint(fn, ..., use_reentrant=False, context_fn=...)`` around
        code that takes keys as it runs (``dropout`` without ``key``), in eager mode (dynamo
        traces no ``context_fn``; hand the code its keys instead): the forward notes how many
        keys each stream has handed out; the recomputation in backward hands out the same keys
        again (so it draws the same masks) and puts the counts back after."""
        saved: dict = {}

        @contextlib.contextmanager
        def forward():
            saved.update({r: t.clone() for r, t in self._keys_out.items()})
            yield

        @contextlib.contextmanager
        def recompute():
            now = {r: t.clone() for r, t in self._keys_out.items()}
            for r, t in saved.items():
                self._keys_out[r].copy_(t)
            try:
                yield
            finally:
                for r, t in now.items():
                    self._keys_out[r].copy_(t)

        return forward(), recompute()


class ParallelDropout(nn.Module):
    """``nn.Dropout`` drawing its masks from one stream of a :class:`TensorParallelRNG`."""

    def __init__(self, p: float, rng: TensorParallelRNG, region: str):
        super().__init__()
        _check_region(region)
        self.p, self.rng, self.region = p, rng, region

    def forward(self, x: torch.Tensor, key: torch.Tensor | None = None,
                site: int = 0) -> torch.Tensor:
        """key, site: which mask of the stream (key None: a new key's)."""
        return self.rng.dropout(x, self.p, self.region, self.training, key, site)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"
