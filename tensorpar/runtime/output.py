"""What every command writes: files replaced atomically, byte counts in human units. No torch
import here."""

from __future__ import annotations

import os
from pathlib import Path

# the one unit system of what tensorpar prints: binary units (a MiB is 2^20 bytes), as torch's
# allocator statistics count; ``tensorpar plan --device-memory`` also reads decimal ones (80GB)
MIB, GIB = 2**20, 2**30


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def write_atomically(path: Path, write) -> None:
    """``write(tmp)`` to a hidden file next to ``path``, then rename it into place: a reader
    sees the old file or the new one, never half of one (and a failed write leaves no tmp)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
