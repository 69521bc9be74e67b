"""The search for a (tp, cp, pp, dp) layout of a number of devices that fits, and the device
constants its ranking proxy assumes.

``search_layouts``: every tp <= 8 that divides the devices and the query heads, every pp that
divides the rest with P·V <= L, dp the rest; context parallelism (every cp that divides the
devices left and cuts the sequence into 2 chunks a rank) only when nothing fits at cp 1; the
batch split over dp, the micro-batches one sequence each unless given. A layout fits when its
largest rank's peak (``pipeline.plan_pipeline``) is within the device memory less the reserve.
Fits are ranked by an estimated step time (``step_seconds``): the model's FLOPs per device at
``DEVICE_FLOPS`` stretched by the bubble, plus each group's bytes sent per rank at
``NODE_BYTES_S`` inside a node of ``GPUS_PER_NODE`` devices and ``NETWORK_BYTES_S`` between
nodes, with no overlap of communication and compute: a ranking proxy that weighs a bubble
against bytes, not a prediction.
"""

from __future__ import annotations

import dataclasses

from tensorpar.parallel.context import check_cp_split
from tensorpar.parallel.sharding import check_expert_parallel
from tensorpar.planner.comm import cp_comm
from tensorpar.planner.moe_comm import moe_comm
from tensorpar.planner.pipeline import plan_pipeline
from tensorpar.planner.shapes import ModelShape
from tensorpar.planner.step import Step

# the search's ranking proxy (step_seconds): an H100-class device at about 40% of its dense bf16
# peak, NVLink inside a node (per direction), one 400 Gb/s NIC per device between nodes
GPUS_PER_NODE = 8
DEVICE_FLOPS = 400e12
NODE_BYTES_S = 450e9
NETWORK_BYTES_S = 50e9


def step_flops(shape: ModelShape, batch: int, seq: int, recompute: str = "none") -> float:
    """FLOPs of a training step: 6 per matmul weight and token (forward 2, backward 4; the head
    included, the embedding's lookup not), and attention's two (T x T) matmuls, 12·T·(h·hd) per
    token and block; a third more with full recomputation (the blocks' forward again)."""
    D, hd = shape.dim, shape.head_dim
    q, kv = shape.n_head * hd, shape.n_kv_head * hd
    block = D * (q + 2 * kv) + q * D + (3 if shape.gated_mlp else 2) * D * shape.hidden_dim
    blocks = shape.n_layer * block
    if shape.moe is not None:  # the weights a token uses: its k experts of each MoE layer
        blocks = sum(block - (3 if shape.gated_mlp else 2) * D * shape.hidden_dim
                     + shape.mlp_params(i, active=True) for i in range(shape.n_layer))
    tokens = batch * seq
    flops = 6 * tokens * (blocks + shape.vocab_size * D)
    flops += 12 * tokens * seq * q * shape.n_layer
    return flops * (4 / 3 if recompute == "full" else 1)


def step_seconds(flops_per_device: float, bubble_fraction: float, tp: int, pp: int, dp: int,
                 sends: dict, ep: int = 1, cp: int = 1) -> float:
    """The search's ranking proxy for a step's time: compute at ``DEVICE_FLOPS`` stretched by
    the bubble, plus the bytes a rank sends on each group ("tp", "cp", "pp", "dp") at
    ``NODE_BYTES_S`` when the group lies inside a node of ``GPUS_PER_NODE`` devices (the mesh
    is ("pp", "dp", "cp", "tp"): tp innermost; the dp group's gradient sum spans the cp ranks
    too) and ``NETWORK_BYTES_S`` when it spans nodes; an MoE model's all-to-alls ("ep", its
    ``ep`` ranks folded from tp outward) likewise; no overlap."""
    span = {"tp": tp, "cp": tp * cp, "dp": tp * cp * dp, "pp": tp * cp * dp * pp,
            "ep": max(ep, tp)}
    seconds = flops_per_device / DEVICE_FLOPS * (1 + bubble_fraction)
    for group, sent in sends.items():
        seconds += sent / (NODE_BYTES_S if span[group] <= GPUS_PER_NODE else NETWORK_BYTES_S)
    return seconds


def expert_sizes(shape: ModelShape, tp: int, dp: int, cp: int = 1) -> list[int]:
    """The EP sizes a search tries at (tp, dp, cp): those ``check_expert_parallel`` takes (the
    trainer's rule); 1 for a dense model."""
    if shape.moe is None:
        return [1]
    return [e for e in range(1, dp * cp * tp + 1) if _folds(e, tp, dp, cp, shape.moe.experts)]


def _folds(ep: int, tp: int, dp: int, cp: int, experts: int) -> bool:
    try:
        check_expert_parallel(ep, tp, dp, experts, cp)
    except ValueError:
        return False
    return True


def plan_layout(step: Step, layout: dict, device_memory: float, reserve: float,
                micro_batches: int | None, micro_batch_size: int | None, flops: float) -> dict:
    """One layout of a search: its row (``search_layouts``), or the layout with "why" the
    schedules refuse it."""
    tp, pp, dp, v, ep, cp = (layout["tp"], layout["pp"], layout["dp"], layout["virtual"],
                             layout.get("ep", 1), layout["cp"])
    batch = step.batch
    if batch % dp:
        return layout | {"why": f"--batch {batch} does not split over dp {dp}"}
    if micro_batch_size and (batch // dp) % micro_batch_size:
        return layout | {"why": f"--micro-batch-size {micro_batch_size} does not divide the "
                         f"{batch // dp} sequences of a copy"}
    m = micro_batches or batch // dp // (micro_batch_size or 1)
    planned = step.replace(tp=tp, pp=pp, dp=dp, virtual=v, micro_batches=m, ep=ep, cp=cp)
    try:
        p = plan_pipeline(planned, device_memory, reserve)
    except ValueError as e:
        return layout | {"why": str(e)}
    sends = max(p["comm"], key=lambda c: c["tp"] + c["pp"] + c["dp"])
    sent = {g: sends[g] for g in ("tp", "pp", "dp")}
    stage = planned.replace(shape=dataclasses.replace(step.shape,
                                                      n_layer=-(-step.shape.n_layer // pp)))
    if cp > 1:  # the K/V all-gathers and reduce-scatters of the largest stage's layers
        sent["cp"] = sum(cp_comm(stage.shape, stage.micro, stage.seq, tp, cp, stage.dtype,
                                 stage.recompute, stage.micro_batches)["ring_bytes"].values())
    if step.shape.moe is not None:  # the all-to-alls of the largest stage's layers
        sent["ep"] = moe_comm(stage)["sent"].get("all_to_all", 0)
    return layout | {
        "micro_batches": m, "micro_batch": p["micro_batch"], "schedule": p["schedule"],
        "total": p["total"], "worst": p["worst"], "fits": p["fits"],
        "peak_at": p["stages"][p["worst"]]["peak_at"], "bubble": p["bubble"],
        "sends": sent,
        "step_seconds": step_seconds(flops, p["bubble"], tp, pp, dp, sent, ep, cp)}


def context_sizes(devices: int, tp: int, seq: int) -> list[int]:
    """The CP sizes a search may try at ``tp``: every divisor of the devices left that cuts the
    sequence into 2 chunks a rank (``parallel.context.check_cp_split``)."""
    rest = devices // tp
    return [c for c in range(1, rest + 1) if rest % c == 0 and 2 * c <= seq or c == 1]


def search_layouts(step: Step, devices: int, device_memory: float, reserve: float = 0.10,
                   micro_batches: int | None = None, tps: list[int] | None = None,
                   pps: list[int] | None = None, micro_batch_size: int | None = None,
                   cps: list[int] | None = None) -> dict:
    """Every (tp, cp, pp, dp) layout of ``devices`` devices the model and schedules allow
    (module docstring), planned as ``step`` (its shape, batch, sequence, precision, recompute,
    dp_mode, ...; its tp, cp, pp, dp and micro-batches are the search's): "layouts" that fit,
    ranked by ``step_seconds``, each with its worst rank's peak, the bubble and the bytes that
    rank sends; "smallest", the layout with the lowest peak when none fits; "skipped", the
    layouts the schedules refuse, with the reason. ``micro_batches``: None, one sequence each
    (batch / dp), or ``micro_batch_size`` sequences each; ``step.virtual`` applies to layouts
    with pp > 1; ``tps``, ``pps`` and ``cps`` restrict the search. Without ``cps``, context
    parallelism (cp > 1) is searched only when no layout fits at cp 1: it is for the sequences
    that do not fit otherwise."""
    if devices < 1:
        raise ValueError(f"--devices {devices} must be >= 1")
    for c in cps or []:
        check_cp_split(step.seq, c, "--cp")
    shape, batch = step.shape, step.batch
    usable = round(device_memory * (1 - reserve))
    candidates = [t for t in range(1, min(GPUS_PER_NODE, devices) + 1)
                  if devices % t == 0 and shape.n_head % t == 0 and (tps is None or t in tps)]
    rows, skipped = [], []
    flops = step_flops(shape, batch, step.seq, step.recompute) / devices
    for cp_wanted in ([cps] if cps else [[1], None]):  # None: every cp above 1
        if cp_wanted is None and any(r["fits"] for r in rows):
            break
        for tp in candidates:
            for cp in context_sizes(devices, tp, step.seq):
                if (cp_wanted is None and cp == 1) or (cp_wanted and cp not in cp_wanted):
                    continue
                rest = devices // (tp * cp)
                for pp in (p for p in range(1, rest + 1) if rest % p == 0):
                    if pps is not None and pp not in pps:
                        continue
                    for ep in expert_sizes(shape, tp, rest // pp, cp):
                        layout = {"tp": tp, "cp": cp, "pp": pp, "dp": rest // pp,
                                  "virtual": step.virtual if pp > 1 else 1}
                        if shape.moe is not None:
                            layout["ep"] = ep
                        row = plan_layout(step, layout, device_memory, reserve, micro_batches,
                                          micro_batch_size, flops)
                        (rows if "why" not in row else skipped).append(row)
    fits = sorted((r for r in rows if r["fits"]), key=lambda r: (r["step_seconds"], r["total"]))
    smallest = min(rows, key=lambda r: r["total"]) if rows else None
    return {"model": shape.name, "devices": devices, "batch": batch, "seq": step.seq,
            "device_memory": device_memory, "usable": usable, "layouts": fits,
            "smallest": None if fits else smallest, "planned": len(rows), "skipped": skipped}
