"""Rotary position embeddings (Su et al., 2021), as in Llama: rotate pairs of channels by angles
that grow with the position.

Heads are split across ranks but each head keeps its full ``head_dim``, so rotary embeddings need
no communication: every rank rotates its own heads with the same table. Positions are absolute, so
a KV cache passes its offset and decoding step ``t`` rotates by ``t``'s angle.
"""

from __future__ import annotations

import torch


def rotary_table(head_dim: int, start: int, length: int, theta: float = 10000.0,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (length, head_dim // 2), for positions ``start .. start + length - 1``."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
                               / head_dim)
    pos = torch.arange(start, start + length, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)  # (length, head_dim/2); float64 keeps far positions exact
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) by the table rows for its T positions.

    Channels i and i + head_dim/2 form a pair (the "rotate half" layout of GPT-NeoX and Llama).
    """
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, hd/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
