"""DTensors (FSDP2's parameters, gradients and optimizer states) without importing them.

``torch.distributed.tensor`` takes most of a second to import; a process that never built one
(every run without data parallelism) need not pay for it. A tensor can only be a DTensor once
that module is loaded, so the check looks there first.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False, cheaply, while that module
    is not even imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's own piece of ``t``: a DTensor's local shard, anything else as it is."""
    return t.to_local() if is_dtensor(t) else t
