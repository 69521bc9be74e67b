"""What the ``verify`` checks share (the block, ``--pp`` and ``--hf``): the relative error they
judge by and its tolerance, the slice of a dense tensor a shard is compared with, and the sizes the
checked block takes at a TP size."""

from __future__ import annotations

import torch

from tensorpar.parallel.sharding import ShardSpec
from tensorpar.transformer.attention import head_shards
from tensorpar.transformer.reference import BlockConfig

TOLERANCE = 1e-5  # fp32, relative


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: the error relative to the tensor's scale."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def dense_shard(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The slice of the dense tensor ``t`` that a parameter with ``spec`` holds."""
    return t if spec is None else spec.take(t)


def check_config(cfg: BlockConfig, n: int, sequence_parallel: bool) -> None:
    """Refuse sizes the TP model cannot take, with the numbers, before any rank starts."""
    if n < 1:
        raise ValueError(f"--tp must be >= 1, got {n}")
    head_shards(cfg.num_heads, cfg.num_kv_heads, n, 0)
    if cfg.dim % cfg.num_heads:
        raise ValueError(f"--dim {cfg.dim} does not divide by --n-head {cfg.num_heads}")
    for flag, value in (("--vocab-size", cfg.vocab_size), ("--hidden-dim", cfg.hidden_dim)):
        if value < n:
            raise ValueError(f"{flag} {value} cannot be split over --tp {n}")
    if sequence_parallel and cfg.seq_len < n:
        raise ValueError(f"--seq-len {cfg.seq_len} is shorter than --tp {n}: sequence "
                         "parallelism needs at least one token per rank")
