"""AdamW, fused where torch has the kernel for the parameters' device.

torch's fused AdamW (``fused=True``) updates every parameter in one kernel per dtype and device,
in place: no per-parameter temporaries. On this project's 2-core CPU it takes 9 ms per step for
the benchmark model's 9.7M parameters per rank against 35 ms for the single-tensor loop CPU gets
by default (``benchmarks/results/2026-11-26/profile.md``); on CUDA it is what torchtitan and
Megatron use.
DTensor parameters take it too. Elsewhere (other devices, non-float parameters) torch picks its
default. The planner models all three implementations (``planner.memory.ADAMW``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorpar.parallel.sharding import is_expert_split

_FUSED_DEVICES = ("cpu", "cuda")


def _groups(params_or_groups) -> list[dict]:
    """Param groups with their "params" as lists (a generator is read once, here)."""
    items = [params_or_groups] if isinstance(params_or_groups, torch.Tensor) \
        else list(params_or_groups)
    if not items or not isinstance(items[0], dict):
        return [{"params": items}]
    out = []
    for group in items:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        out.append(group | {"params": params})
    return out


def fusable(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes these parameters (float, on CPU or CUDA)."""
    params = list(params)
    return bool(params) and all(p.device.type in _FUSED_DEVICES and p.is_floating_point()
                                for p in params)


def adamw(params_or_groups, **hyper) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params_or_groups, **hyper)``, fused when ``fusable`` and the caller
    chose neither ``fused`` nor ``foreach``."""
    groups = _groups(params_or_groups)
    if "fused" not in hyper and "foreach" not in hyper:
        hyper["fused"] = fusable(p for g in groups for p in g["params"]) or None
    return torch.optim.AdamW(groups, **hyper)


def implementation(opt: torch.optim.Optimizer) -> str:
    """How ``opt`` (an AdamW) steps, as the planner names it: "fused", "foreach" or "for-loop".

    A group's own setting wins over the optimizer's; without one, torch's default for plain
    tensors: foreach when every parameter is on CUDA, else the loop (torch also loops over
    DTensor parameters on CUDA). Groups that differ give the one with the most temporaries.
    """
    kinds = set()
    for group in opt.param_groups:
        if group.get("fused", opt.defaults.get("fused")):
            kinds.add("fused")
            continue
        foreach = group.get("foreach", opt.defaults.get("foreach"))
        if foreach is None:
            foreach = all(p.device.type == "cuda" and type(p) in (torch.Tensor, torch.nn.Parameter)
                          for p in group["params"])
        kinds.add("foreach" if foreach else "for-loop")
    for kind in ("foreach", "for-loop", "fused"):
        if kind in kinds:
            return kind
    return "fused"


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """The trainer's AdamW (``cfg``: lr, weight_decay) over the trainable parameters; no weight
    decay on the vectors: norms (the GPT's only ones) and biases. Experts split over EP ranks
    (plain tensors beside FSDP2's DTensors, which one fused kernel call cannot mix) are a group
    of their own."""
    trained = [p for p in model.parameters() if p.requires_grad]  # not a LoRA run's base
    experts = [p for p in trained if is_expert_split(p)]
    decay = [p for p in trained if p.ndim >= 2 and not is_expert_split(p)]
    no_decay = [p for p in trained if p.ndim < 2]
    return adamw([{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
                 + ([{"params": experts, "weight_decay": cfg.weight_decay}] if experts else []),
                 lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
