"""The expert-parallel communication of a step of an MoE model, predicted: the all-to-alls of
``ParallelMoE`` (``transformer/moe.py``) and the router statistics' all-reduce.

Per MoE layer and pass, at EP size e > 1, a TP rank routes n tokens (its ``tensor_split`` share
of the pass's N = B·T, or under SP its sequence shard; under CP T is a CP rank's chunks) to k
experts each::

    forward    all-to-all of the expert counts            E int64 (the sizes of what follows)
               all-to-all of the rows to their experts    n·k rows of D (the normed input's dtype)
               all-to-all of the experts' outputs back    n·k rows of D (the experts' dtype)
    backward   the two row all-to-alls reversed           n·k rows of D each
    statistics one all-reduce of 2E + 2 fp32 numbers over the tokens' ranks (dp x cp x tp > 1)

Calls are exact (``moe_collective_counts``, times the MoE layers and passes; full recomputation
runs each layer's forward again). Bytes are an expectation: routing is data-dependent, and with
even routing a rank keeps 1/e of its rows on its own experts, so (e - 1)/e of each row
all-to-all's payload leaves the rank ("sent"). The MoE layer's TP collectives (the tokens'
gather, the router's gradient sum, the shared experts as the MLP) are ``comm.predicted_comm``'s.
"""

from __future__ import annotations

from tensorpar.parallel.sharding import shard_sizes
from tensorpar.planner.step import Step
from tensorpar.transformer.moe import moe_collective_counts


def _stats_ranks(step: Step) -> int:
    """The router statistics' group: every rank of a stage holding other tokens (dp x cp x tp)."""
    return step.dp_ranks * step.tp


def moe_comm(step: Step, rank: int = 0) -> dict:
    """TP rank ``rank``'s expert-parallel collectives in one step of ``step`` (its micro-batches'
    passes of ``step.micro`` sequences): {"counts": {kind: calls}, "bytes": {kind: payload},
    "sent": {kind: bytes leaving the rank}, "breakdown": rows}; empty for a dense model."""
    shape, tp, ep = step.shape, step.tp, step.ep
    empty = {"counts": {}, "bytes": {}, "sent": {}, "breakdown": []}
    if shape.moe is None:
        return empty
    m, D = shape.moe, shape.dim
    layers = m.moe_layers(shape.n_layer) * step.micro_batches
    seq = step.rank_seq  # a CP rank's tokens of each sequence (all of them without CP)
    sp = step.sequence_parallel and tp > 1
    n = step.micro * shard_sizes(seq, tp)[rank] if sp else shard_sizes(step.micro * seq, tp)[rank]
    rows = n * m.top_k * D
    res_b = 4  # the normed input (fp32 residual stream); the experts' outputs in autocast's
    out_b = 2 if step.dtype in ("bf16", "bf16-autocast") else 4
    share = (ep - 1) / ep
    forward = 2 if step.recompute == "full" else 1  # a recomputed layer's forward again
    out = []

    def add(source, phase, kind, calls, payload, leaves):
        out.append({"source": source, "phase": phase, "kind": kind, "calls": calls,
                    "bytes": calls * payload, "sent": round(calls * payload * leaves)})

    if ep > 1:
        add("expert counts", "forward", "all_to_all", forward * layers, 8 * m.experts, share)
        add("rows to experts", "forward", "all_to_all", forward * layers, rows * res_b, share)
        add("outputs back", "forward", "all_to_all", forward * layers, rows * out_b, share)
        add("output gradients to experts", "backward", "all_to_all", layers, rows * out_b, share)
        add("row gradients back", "backward", "all_to_all", layers, rows * res_b, share)
    holders = _stats_ranks(step)
    if holders > 1:
        stats = 4 * (2 * m.experts + 2)
        add("router statistics", "forward", "all_reduce", forward * layers, stats,
            2 * (holders - 1) / holders)
    kinds = sorted({r["kind"] for r in out})
    return {k: {kind: sum(r[key] for r in out if r["kind"] == kind) for kind in kinds}
            for k, key in (("counts", "calls"), ("bytes", "bytes"), ("sent", "sent"))} | \
        {"breakdown": out}


def expected_calls(step: Step) -> dict[str, int]:
    """The EP collectives' calls of a step from the layer's own count
    (``transformer.moe.moe_collective_counts``): its all-to-alls and the statistics'
    all-reduce, times the MoE layers and passes (forward again when recomputed)."""
    m = step.shape.moe
    # at TP 1 the layer's count holds only the EP group's and the statistics' collectives
    c = moe_collective_counts(1, step.ep, _stats_ranks(step), bool(m.shared_hidden))
    layers = m.moe_layers(step.shape.n_layer) * step.micro_batches
    forward = 2 if step.recompute == "full" else 1
    kinds = c["forward"].keys() | c["backward"].keys()
    return {k: layers * (forward * c["forward"].get(k, 0) + c["backward"].get(k, 0))
            for k in sorted(kinds)}


def moe_summary(step: Step, tps: list[int] | None = None) -> dict:
    """What ``tensorpar plan`` shows of an MoE model (nothing for a dense one): its active
    parameters (with and without the input embedding table: publishers count both ways), its
    routed experts' parameters, the EP size, and the EP collectives of a step at each TP size
    of ``tps`` (default the step's)."""
    shape = step.shape
    if shape.moe is None:
        return {}
    return {"params_active": shape.params(active=True),
            "params_active_no_embedding": shape.params(active=True, embedding=False),
            "params_experts": shape.expert_params(), "ep": step.ep,
            "ep_comm": {str(tp): moe_comm(step.replace(tp=tp)) for tp in (tps or [step.tp])}}
