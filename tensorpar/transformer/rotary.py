"""Rotary position embeddings (Su et al., 2021), as in Llama: rotate pairs of channels by angles
that grow with the position.

Heads are split across ranks but each head keeps its full ``head_dim``, so rotary embeddings need
no communication: every rank rotates its own heads with the same table. Positions are absolute, so
a KV cache passes its offset and decoding step ``t`` rotates by ``t``'s angle. In a left-padded
batch each sequence counts its own positions from its first real token (``rotary_table_at``), so
a prompt is rotated the same whether it is alone or padded next to longer ones.
"""

from __future__ import annotations

import torch


def rotary_table(head_dim: int, start: int, length: int, theta: float = 10000.0,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (length, head_dim // 2), for positions ``start .. start + length - 1``.

    One op to ``torch.compile`` (``tensorpar::rotary_table``), so the table is made once per
    forward: inlined, inductor computes the float64 powers, cosines and sines again for every
    element of q and k that it rotates, in every block, forward and backward."""
    _check_even(head_dim)  # here, where it is raised eagerly, even under torch.compile
    device = torch.get_default_device() if device is None else torch.device(device)
    return _rotary_table_op(head_dim, start, length, theta, device)


@torch.library.custom_op("tensorpar::rotary_table", mutates_args=())
def _rotary_table_op(head_dim: int, start: int, length: int, theta: float,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 table of ``rotary_table`` (computed in float64)."""
    pos = torch.arange(start, start + length, device=device, dtype=torch.float64)
    return _table(head_dim, pos, theta)


@_rotary_table_op.register_fake
def _(head_dim, start, length, theta, device):
    shape = (length, head_dim // 2)
    return (torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))


def rotary_table_at(head_dim: int, positions_BT: torch.Tensor, theta: float = 10000.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (B, 1, T, head_dim // 2), for a position per sequence and token (a
    padded batch); the 1 broadcasts over heads in ``apply_rotary``."""
    cos, sin = _table(head_dim, positions_BT.to(torch.float64), theta)  # (B, T, hd/2) each
    return cos[:, None], sin[:, None]


def _check_even(head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")


def _table(head_dim: int, pos: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_even(head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device,
                                            dtype=torch.float64) / head_dim)
    angles = pos[..., None] * inv_freq  # (..., head_dim/2); float64 keeps far positions exact
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) by the table rows for its T positions: cos and sin
    (T, head_dim/2), or (B, 1, T, head_dim/2) for positions per sequence.

    Channels i and i + head_dim/2 form a pair (the "rotate half" layout of GPT-NeoX and Llama).
    """
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, hd/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
