"""Seeds of the random streams, each derived by hashing (seed, purpose, coordinates).

Adding offsets makes streams collide: with ``seed * K + step`` for the step and ``+ tp_rank`` for
the shard, rank r at step s draws exactly the masks rank r - 1 draws at step s + 1. A hash of every
coordinate gives each (purpose, step, rank, ...) a stream of its own, and the same stream again
whenever the same coordinates come back (a resumed run, a recomputed forward).

The purposes tensorpar draws from (``README.md``, "Randomness", has the table)::

    init              (parameter name)                 the GPT's weights
    data-order        (epoch)                          the permutation of the training windows
    dropout-replicated (step, dp rank[, cp rank])      masks of activations every TP rank holds
    dropout-sharded   (step, dp rank, tp rank[, cp rank]) masks of activations split over TP ranks
                                                       (the cp rank only under context parallelism:
                                                       its ranks hold different tokens)
    dropout-site      (key number, site), under one    one dropout mask: the stream's key c,
                      of the two streams' seeds         site k (parallel/dropout.py)
    hf-tp-region      (dp rank, tp rank)               HF dropout between f and g (heads, hidden);
                      (step, dp rank, tp rank)         under ``tensorpar train --hf``
    hf-dropout        (step, dp rank)                  ``train --hf``: torch's global generator,
                                                       HF dropout outside the TP regions
    lora-dropout      (step, dp rank)                  LoRA's adapter dropout: the masks are
                                                       its dropout-site masks (forward number,
                                                       layer), drawn dense (parallel/lora.py)
    sampling          ()                               generation's Gumbel noise
"""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, purpose: str, *coords: int | str) -> int:
    """A 63-bit seed for the stream ``purpose`` at ``coords``: a BLAKE2b hash of all of them,
    so two streams share a seed only if every coordinate is the same."""
    key = repr((int(seed), purpose, *coords)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
