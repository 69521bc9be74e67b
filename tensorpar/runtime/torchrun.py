"""Whether this process is one of torchrun's ranks, and which process prints a command's lines.

Spawned by tensorpar's launcher, the ranks return their results and the launcher prints. Under
torchrun every process is a rank that computes the same result and exit status, and global rank
0 prints for them (``speaks``), so a table or a completion appears once. Read from the
environment torchrun sets, without importing torch (``python -m tensorpar`` asks before it
does).
"""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run, elastic) started this process as a rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def speaks() -> bool:
    """Whether this process prints the command's lines: rank 0 under torchrun; any process
    outside it (a launcher, whatever ``RANK`` a scheduler left in its environment)."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


def say(*args, **kwargs) -> None:
    """``print``, in the process that speaks; nothing elsewhere."""
    if speaks():
        print(*args, **kwargs)
