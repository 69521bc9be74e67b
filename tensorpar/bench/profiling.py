"""Where a step's time goes: torch.profiler's events sorted into a few categories.

Each event's *self* CPU time (its time minus its children's) is counted once, so the categories
add up to the profiled CPU time of the thread that ran the steps. An event inside the optimizer's
step (``Optimizer.step#AdamW.step``) counts as optimizer whatever its op; otherwise its name
decides::

    matmul                    aten::mm, addmm, bmm, ... (forward and backward GEMMs)
    attention                 scaled_dot_product_attention and its kernels
    collectives and waiting   c10d / gloo ops (the time a rank waits for the others included),
                              and the self time of a Python-level range that directly issues
                              one (an autograd Function waiting on its asynchronous work)
    optimizer                 everything under the optimizer's step
    elementwise/norm          the other aten ops: adds, silu, rms_norm, copies, views ...; and
                              the self time of a compiled graph's call (``## Call
                              CompiledFxGraph ...``), which is inductor's fused kernels
    framework                 what is not an aten op: autograd engine, Python-level ranges
"""

from __future__ import annotations

from collections import defaultdict

CATEGORIES = ("matmul", "attention", "collectives and waiting", "optimizer", "elementwise/norm",
              "framework")
_COLLECTIVE = ("c10d", "gloo", "allreduce", "all_reduce", "allgather", "all_gather",
               "reduce_scatter", "_reduce_scatter", "barrier", "wait_tensor", "record_param_comms",
               "nccl")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
           "aten::linear", "aten::_addmm_activation", "aten::addmv", "aten::mv")
_COMPILED_GRAPH = "## Call CompiledFxGraph"
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "_attention")


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in _COLLECTIVE)


def category(name: str, in_optimizer: bool, issues_collective: bool = False) -> str:
    """The category of an event called ``name``; ``issues_collective``: one of its direct
    children is a collective (gloo's collectives are asynchronous: the wait for them is spent
    in the caller, an autograd Function for tensorpar)."""
    if in_optimizer:
        return "optimizer"
    low = name.lower()
    if name.startswith(_COMPILED_GRAPH):
        return "elementwise/norm"
    if _is_collective(name) or (issues_collective and not name.startswith("aten::")):
        return "collectives and waiting"
    if name.startswith(_MATMUL):
        return "matmul"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if name.startswith("aten::"):
        return "elementwise/norm"
    return "framework"


def _in_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.step"):
            return True
        event = event.cpu_parent
    return False


def summarize(prof, wall_s: float, steps: int, top: int = 15) -> dict:
    """Per step: wall time, self CPU milliseconds by category, and the ``top`` ops by self time
    (name, category, milliseconds, calls)."""
    by_cat: dict[str, float] = defaultdict(float)
    by_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        self_us = ev.self_cpu_time_total
        issues = any(_is_collective(child.name) for child in ev.cpu_children)
        cat = category(ev.name, _in_optimizer(ev), issues)
        by_cat[cat] += self_us
        entry = by_op[(ev.name, cat)]
        entry[0] += self_us
        entry[1] += 1
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall_s / steps,
        "categories_ms_per_step": {c: by_cat.get(c, 0.0) / 1e3 / steps for c in CATEGORIES},
        "top_ops": [{"name": name, "category": cat, "ms_per_step": us / 1e3 / steps,
                     "calls_per_step": calls / steps} for (name, cat), (us, calls) in ops],
    }


def ops_per_step(prof, steps: int) -> dict[str, list[float]]:
    """{op name: [self CPU ms, calls]} a step, over ``steps`` profiled steps."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.key_averages():
        out[ev.key][0] += ev.self_cpu_time_total / 1e3 / steps
        out[ev.key][1] += ev.count / steps
    return dict(out)
