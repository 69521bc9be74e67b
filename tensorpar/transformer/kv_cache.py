"""Key/value cache for decoding, sharded by heads like the attention that fills it.

Each rank caches only the K/V heads it holds (``ParallelSelfAttention.kv_heads``), so the cache of a
TP group takes 1/n of the memory per rank (KV heads shared by several ranks, with fewer KV heads
than ranks, are cached by each rank that reads them). Decoding needs no extra communication: the
attention of a new token runs on local heads, exactly as in the forward pass. In a left-padded
batch the padding's keys and values are cached like any others; the attention mask
(``padded_causal_mask``) keeps every query off them.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """Preallocated K and V of one attention layer: (B, kv_heads_local, max_len, head_dim)."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, h, T, hd) after the cached positions; return all of them so far."""
        B, h, T, hd = k.shape
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {self.length} are used "
                             f"and {T} more were given")
        if self.k is None:
            self.k = k.new_empty(B, h, self.max_len, hd)
            self.v = v.new_empty(B, h, self.max_len, hd)
        self.k[:, :, self.length:self.length + T] = k
        self.v[:, :, self.length:self.length + T] = v
        self.length += T
        return self.k[:, :, :self.length], self.v[:, :, :self.length]


class KVCache:
    """One :class:`LayerKVCache` per layer; ``length`` is the number of positions cached."""

    def __init__(self, n_layers: int, max_len: int):
        self.layers = [LayerKVCache(max_len) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length
