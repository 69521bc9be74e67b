"""AdamW, fused where torch has the kernel for the parameters' device.

torch's fused AdamW (``fused=True``) updates every parameter in one kernel per dtype and device,
in place: no per-parameter temporaries, and 4-5x faster than the single-tensor loop CPU gets by
default (5 ms against 23 ms for the benchmark model's 7.7M parameters per rank, one thread;
on CUDA it is what torchtitan and Megatron use too). It works on plain tensors and on DTensor
parameters alike. Elsewhere (other devices or non-float parameters) torch picks its default.
The planner models all three implementations (``planner.ADAMW``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_FUSED_DEVICES = ("cpu", "cuda")


def _params(params_or_groups) -> list[torch.Tensor]:
    items = list(params_or_groups)
    if items and isinstance(items[0], dict):
        return [p for group in items for p in group["params"]]
    return items


def fusable(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes these parameters (float, on CPU or CUDA)."""
    params = list(params)
    return bool(params) and all(p.device.type in _FUSED_DEVICES and p.is_floating_point()
                                for p in params)


def adamw(params_or_groups, **hyper) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params_or_groups, **hyper)``, fused when ``fusable``."""
    items = list(params_or_groups)
    fused = fusable(_params(items)) or None
    return torch.optim.AdamW(items, fused=fused, **hyper)


def implementation(opt: torch.optim.Optimizer) -> str:
    """How ``opt`` (an AdamW) steps, as the planner names it: "fused", "foreach" or "for-loop"
    (torch's default: foreach when every parameter is on CUDA, else the loop)."""
    if opt.defaults.get("fused"):
        return "fused"
    foreach = opt.defaults.get("foreach")
    if foreach is None:
        params = [p for group in opt.param_groups for p in group["params"]]
        foreach = all(p.device.type == "cuda" for p in params)
    return "foreach" if foreach else "for-loop"
