"""What every command writes: files replaced atomically, byte counts in human units, and its
lines, printed once for all ranks.

Spawned by tensorpar's launcher, the ranks return their results and the launcher prints. Under
torchrun every process is a rank that computes the same result and exit status, and global rank
0 prints for them (``speaks``), so a table or a completion appears once. No torch import here.
"""

from __future__ import annotations

import os
from pathlib import Path


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


def speaks() -> bool:
    """Whether this process prints the command's lines: rank 0 under torchrun; any process
    outside it (a launcher, whatever ``RANK`` a scheduler left in its environment)."""
    return "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("RANK", "0") == "0"


def say(*args, **kwargs) -> None:
    """``print``, in the process that speaks; nothing elsewhere."""
    if speaks():
        print(*args, **kwargs)
