"""Pipeline parallelism, planned: each pipeline rank's memory, the bubble, the point-to-point
bytes, and the search for a (tp, pp, dp) layout that fits a number of devices.

What ``tensorpar train --pp P`` runs (``train/pipeline.py``): the GPT's L blocks cut into
S = P·V stages as ``torch.tensor_split`` cuts L (consecutive, sizes differing by at most one,
the larger first), stage s on pipeline rank s % P (V = ``--pp-virtual`` stages per rank), the
embedding on stage 0, the final norm, head and loss on stage S - 1; the mesh is ("pp", "dp",
"tp"), the stages outermost. The m micro-batches are gradient accumulation's passes, each of
batch / (dp·m) sequences, run by torch's ``Schedule1F1B`` (V = 1) or
``ScheduleInterleaved1F1B`` (V > 1).

**Bubble** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", sections 2.2.1-2.2.2): the idle time of a step over its ideal time,
(P - 1) / m under 1F1B, (P - 1) / (V·m) interleaved (each rank's V stages are V times shorter).

**Activations in flight.** 1F1B runs P - k forwards on rank k before its first backward (torch's
warmup), so rank 0 holds P micro-batches' activations of its L/P blocks, rank P - 1 one.
Interleaved, torch 2.13 warms rank k up with (V - 1)·r + 2·(P - 1 - k) forwards of a stage
(r = m / max(1, m // P) micro-batches per round, P when P divides m), then runs one more before
its first backward: rank 0 holds P·V + P - 1 stage micro-batches of L/(P·V) blocks each, that is
P·(1 + (P - 1)/(P·V)) micro-batches of its L/P blocks, more than 1F1B's P (interleaving does not
reduce activation memory: the paper, section 2.2.2; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.3, gives the same factor
1 + (P - 1)/(P·V) for the first stage). ``schedule_ops`` replays torch's order forward by
backward (``tests/planner/test_pipeline_plan.py`` compares it with torch's own), and
``rank_memory`` takes the largest moment of that replay.

**A rank's memory** (``rank_memory``), built from the one-model planner's pieces of one
micro-batch (``layouts.step_memory`` at its batch; ``micro_batch_pieces``):

- weights, gradients, AdamW states: those of the rank's blocks, plus the embedding (and a
  learned position table) on the rank of stage 0, the final norm and the head on the rank of
  stage S - 1 (``stage_tensors``); under FSDP2 each rank's 1/dp share, as
  ``data_parallel.py`` counts it. A tied head is a copy of the embedding table on the rank of
  stage S - 1 (weights, gradients and AdamW states there too).
- activations, per micro-batch of a stage: its blocks' kept tensors (``block``), the
  embedding's output, ids and mask on stage 0 (``embedding``), the final norm's, head's and
  loss's on stage S - 1 (``tail``), and once per rank the rotary tables (``rope``).
- point-to-point buffers: torch's ``PipelineStage`` allocates, once, a receive buffer for each
  micro-batch's input on every stage but the first (it is the stage's input, kept for backward)
  and for each micro-batch's output gradient on every stage but the last: (m · micro, T, D) fp32
  each (T/tp tokens under sequence parallelism).
- the moment of the step: after each forward and at each backward (the backward's temporaries:
  a block's, or the loss backward's on the last stage; ``inside`` and ``loss_backward``), the
  activations of the micro-batches in flight plus the gradients of every stage that has run a
  backward: they accumulate over the step's micro-batches and are reduced after the last (torch
  holds DDP's all-reduce and FSDP2's reduce-scatter back until then, so FSDP2's accumulated
  gradients are unsharded, in fp32 under its bf16 mixed precision). A stage's gradients are
  counted whole from the start of its first backward: a little above for that one backward.
- FSDP2: the trainer keeps each block's gathered weights from its first forward to the end of
  the step (``reshard_after_forward=False``: a stage runs up to P forwards before its first
  backward), so a rank holds its stages' gathered weights for the whole step, and reduce-scatters
  each block's gradients after the last backward from one more block-sized buffer. Without a
  pipeline (P = 1, accumulation only) ``tensorpar.dp.wrap`` gathers the root, a block and the next
  one. DDP: its buckets, one more gradient-sized buffer for the whole run.
- the optimizer step: the gradients (FSDP2's sharded) and AdamW's temporaries.

P = 1 with one micro-batch is ``layouts.plan_memory``'s row itself.

**Point to point** (``p2p``): each stage boundary carries, per micro-batch, one activation
forward and one gradient backward, (micro, T, D) fp32 each (T/tp tokens under sequence
parallelism: each TP rank sends its own shard to the same TP rank of the next stage); a step
makes 2·m·(S - 1) sends; rank k sends m·(V - [k = P-1]) activations and m·(V - [k = 0])
gradients. A tied table adds, on the first and the last rank, one all-reduce of its gradient
(the rank's shard of it) over the two (``tied_sync``).

**Search** (``search_layouts``): every tp <= 8 that divides the devices and the query heads, every
pp that divides the rest with P·V <= L, dp the rest; the batch split over dp, the micro-batches
one sequence each unless given. A layout fits when its largest rank's peak is within the device
memory less the reserve. Fits are ranked by an estimated step time (``step_seconds``): the
model's FLOPs per device at ``DEVICE_FLOPS`` stretched by the bubble, plus each group's bytes
sent per rank at ``NODE_BYTES_S`` inside a node of ``GPUS_PER_NODE`` devices and
``NETWORK_BYTES_S`` between nodes, with no overlap of communication and compute: a ranking proxy
that weighs a bubble against bytes, not a prediction.
"""

from __future__ import annotations

import dataclasses

from tensorpar.parallel.sharding import shard_sizes
from tensorpar.parallel.stages import check_pipeline, rank_stages, stage_blocks
from tensorpar.planner.comm import predicted_comm
from tensorpar.planner.data_parallel import (
    dp_comm,
    fsdp_elements,
    partly_owned,
    tensor_shapes,
)
from tensorpar.planner.layouts import check_step, plan_memory, step_memory
from tensorpar.planner.memory import rank_shapes, step_temporaries
from tensorpar.planner.shapes import ModelShape
from tensorpar.runtime.counting import KINDS, ring_share
from tensorpar.transformer.attention import head_layout

ACTIVATION_BYTES = 4  # the residual stream between stages: fp32, as the trainer declares it
# the search's ranking proxy (step_seconds): an H100-class device at about 40% of its dense bf16
# peak, NVLink inside a node (per direction), one 400 Gb/s NIC per device between nodes
GPUS_PER_NODE = 8
DEVICE_FLOPS = 400e12
NODE_BYTES_S = 450e9
NETWORK_BYTES_S = 50e9


def bubble(pp: int, virtual: int, micro_batches: int) -> float:
    """The pipeline bubble, idle over ideal time: (P - 1) / (V·m) (Narayanan et al. 2021)."""
    return (pp - 1) / (virtual * micro_batches)


def schedule_ops(pp: int, virtual: int, micro_batches: int, rank: int) -> list[tuple[str, int]]:
    """The forwards ("F") and backwards ("B") pipeline rank ``rank`` runs in a step, in order,
    each with its local stage (0 .. V-1), as torch 2.13 orders them: ``Schedule1F1B`` (V = 1)
    warms up with min(m, P - rank) forwards, then runs a backward and a forward in turn;
    ``ScheduleInterleaved1F1B`` warms up with (V - 1)·r + 2·(P - 1 - rank) forwards (at most
    V·m; r micro-batches per round), then a forward and a backward in turn, forwards visiting its
    stages r micro-batches at a time in order, backwards in reverse."""
    m, v = micro_batches, virtual
    if v == 1:
        warmup = min(m, pp - rank)
        ops = [("F", 0)] * warmup
        for i in range(m):
            ops.append(("B", 0))
            if warmup + i < m:
                ops.append(("F", 0))
        return ops
    per_round = m // max(1, m // pp)
    total = v * m
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def forward(k):
        return ("F", (k // per_round) % v)

    def backward(j):
        return ("B", v - 1 - (j // per_round) % v)

    ops = [forward(k) for k in range(warmup)]
    for j in range(total - warmup):
        ops += [forward(warmup + j), backward(j)]
    return ops + [backward(j) for j in range(total - warmup, total)]


def p2p(pp: int, virtual: int, micro_batches: int, rank: int, micro: int, seq: int,
        dim: int, tp: int, sequence_parallel: bool, tp_rank: int = 0) -> dict:
    """What pipeline rank ``rank`` sends in a step: "activations" (to the next stage) and
    "gradients" (to the one before), "bytes_each" ((micro, T, D) fp32; under SP the tokens of
    TP rank ``tp_rank``'s shard, by default the largest) and "bytes", their total."""
    tokens = shard_sizes(seq, tp)[tp_rank] if sequence_parallel else seq
    each = micro * tokens * dim * ACTIVATION_BYTES
    activations = micro_batches * (virtual - (rank == pp - 1)) if pp > 1 else 0
    gradients = micro_batches * (virtual - (rank == 0)) if pp > 1 else 0
    return {"activations": activations, "gradients": gradients, "bytes_each": each,
            "bytes": (activations + gradients) * each}


def step_transfers(pp: int, virtual: int, micro_batches: int, rank: int, micro: int, seq: int,
                   dim: int, tp: int, sequence_parallel: bool, tp_rank: int = 0) -> dict:
    """What pipeline rank ``rank`` (TP rank ``tp_rank``) moves over the pipeline in a training
    step, as ``CollectiveCounter`` counts it: {"counts": {kind: calls}, "bytes": {kind: payload}}.
    It receives as many tensors as it sends (``p2p``), and all-reduces two fp32 scalars: the
    step's loss and the gradient norm's sum of squares."""
    sent = p2p(pp, virtual, micro_batches, rank, micro, seq, dim, tp, sequence_parallel, tp_rank)
    n = sent["activations"] + sent["gradients"]
    return {"counts": {"send": n, "recv": n, "all_reduce": 2},
            "bytes": {"send": sent["bytes"], "recv": sent["bytes"], "all_reduce": 8}}


def tied_sync(shape: ModelShape, tp: int, pp: int, rank: int, tp_rank: int = 0, dp: int = 1,
              fsdp: bool = False, grad_bytes: int = 4) -> dict:
    """The tied table's gradient sum on pipeline rank ``rank`` (TP rank ``tp_rank``, dp rank 0)
    in a step, as ``step_transfers`` counts: one all-reduce over the embedding group (the first
    and the last pipeline rank) of its (vocab / tp, D) shard's gradient, its dp rank's chunk of
    rows under FSDP2; nothing on a middle rank, for an untied head or without a pipeline."""
    if pp == 1 or not shape.tie_embeddings or rank not in (0, pp - 1):
        return {"counts": {}, "bytes": {}}
    rows = shard_sizes(shape.vocab_size, tp)[tp_rank]
    rows = -(-rows // dp) if fsdp else rows  # FSDP2's first chunk
    return {"counts": {"all_reduce": 1}, "bytes": {"all_reduce": rows * shape.dim * grad_bytes}}


def add_transfers(a: dict, b: dict) -> dict:
    """Two counts ({"counts": {kind: calls}, "bytes": {kind: payload}}) added."""
    return {k: {kind: a[k].get(kind, 0) + b[k].get(kind, 0) for kind in a[k].keys() | b[k].keys()}
            for k in ("counts", "bytes")}


def micro_batch_pieces(shape: ModelShape, tp: int, micro: int, seq: int, dtype: str,
                       sequence_parallel: bool, recompute: str, optimizer: str, dropout: bool,
                       device: str, fsdp_bf16: bool) -> dict:
    """Bytes one micro-batch of ``micro`` sequences keeps on TP rank 0, by piece, from the
    one-model planner (``layouts.step_memory`` of a one-block model): "block" (one block's kept
    tensors), "embedding" (the embedding's output, and its ids and mask at TP > 1: memory.py's
    embed term), "tail" (final norm, the head's input and bf16 copy, the logits' buffer, the loss
    statistics), "rope" (the rotary tables, once per rank), "inside" (what a block's backward
    adds), "loss_backward" (what the loss backward adds). The tail is what the model keeps
    beyond "between", which memory.py documents as the activations less the tail plus the head's
    fp32 gradient. fsdp_bf16: FSDP2's bf16 gathered weights, under which no autocast copy of a
    weight is kept (as ``data_parallel.dp_memory`` takes them out)."""
    one = dataclasses.replace(shape, n_layer=1)
    mem = step_memory(one, tp, micro, seq, dtype, sequence_parallel, recompute, optimizer,
                      dropout, device)
    b, copies = mem["blocks"], mem["blocks"]["copies"]

    def strip(key):
        return b[key] - (copies[key] if fsdp_bf16 else 0)

    activations = mem["activations"] - (mem["copies"]["activations"] if fsdp_bf16 else 0)
    head_grad = 4 * rank_shapes(shape, tp, 0)["vocab"] * shape.dim
    tail = activations - strip("between") + head_grad
    N = micro * seq
    Ns = micro * shard_sizes(seq, tp)[0] if sequence_parallel and tp > 1 else N
    embedding = Ns * shape.dim * 4 + (N * 12 if tp > 1 else 0)
    kept = strip("kept")
    return {"block": kept, "embedding": embedding, "tail": tail,
            "rope": activations - kept - tail - embedding, "inside": strip("inside"),
            "loss_backward": mem["peaks"]["loss backward"] - mem["activations"]}


def stage_tensors(shape: ModelShape, tp: int, first: bool, last: bool) -> dict:
    """TP rank 0's parameter tensors (name, dim 0, elements per row) of a pipeline rank: "root"
    (the embedding and a position table if it holds stage 0, the final norm and the head if it
    holds the last: a tied head is a copy of the embedding table) and "block" (one block's, as
    ``data_parallel.tensor_shapes``)."""
    t = tensor_shapes(shape, tp, 0)
    tied = last and shape.tie_embeddings  # the last stage's head: a copy of the table
    root = [x for x in t["root"] if (first and x[0].startswith(("embed.", "pos.")))
            or (last and x[0].startswith(("norm.", "lm_head.")))
            or (tied and not first and x[0].startswith("embed."))]
    return {"root": root, "block": t["block"]}


def _elements(tensors: list[tuple]) -> int:
    return sum(d0 * row for _, d0, row in tensors)


def _unsharded(tensors: list[tuple], dp: int, fsdp: bool) -> int:
    """Elements of ``tensors`` whole: as they are, or as FSDP2 gathers them (padded)."""
    return fsdp_elements(tensors, dp)["unsharded"] if fsdp else _elements(tensors)


def _dtype_bytes(dtype: str) -> tuple[int, int, int]:
    """Bytes per element of the stored weights and gradients, of the gathered (FSDP2) weights,
    and of AdamW's states: fp32 4, 4, 8; Megatron-style bf16 2, 2, 12 (fp32 master weights);
    tensorpar's bf16 autocast 4, 2 (FSDP2's bf16 gathers), 8."""
    return {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "bf16-autocast": (4, 2, 8)}[dtype]


def rank_memory(shape: ModelShape, tp: int, pp: int, virtual: int, micro_batches: int,
                rank: int, micro: int, seq: int, dtype: str = "bf16",
                sequence_parallel: bool = False, recompute: str = "none",
                optimizer: str = "fused", dropout: bool = False, device: str = "cpu",
                dp: int = 1, dp_mode: str = "fsdp") -> dict:
    """Pipeline rank ``rank``'s bytes in a step of ``micro_batches`` micro-batches of ``micro``
    sequences (TP rank 0, dp rank 0): weights, gradients, AdamW states, the activations in
    flight at the peak ("in_flight": micro-batches of each of its stages then), the
    point-to-point buffers ("pp_buffers"), data parallelism's ("dp_buffers": FSDP2's gathered
    weights and reduce-scatter buffer, DDP's buckets), "peak_bytes" at "peak_at" above the
    weights and states, and "total". The module docstring lists each term."""
    S = pp * virtual
    mine = rank_stages(pp, virtual, rank)
    blocks = stage_blocks(shape.n_layer, S)
    first, last = 0 in mine, S - 1 in mine
    row = {"stage": rank, "stages": mine,
           "blocks": [f"{blocks[s].start}-{blocks[s].stop - 1}" for s in mine],
           "layers": sum(len(blocks[s]) for s in mine), "first": first, "last": last}
    fsdp = dp > 1 and dp_mode == "fsdp"
    if pp == 1 and micro_batches == 1:  # no pipeline, one pass: the one-model row itself
        one = plan_memory(shape, tp, micro * dp, seq, dtype, sequence_parallel, recompute,
                          optimizer=optimizer, dropout=dropout, device=device, dp=dp,
                          dp_mode=dp_mode)
        return row | {k: one[k] for k in ("params_per_rank", "weights", "grads", "optimizer",
                                          "activations", "dp_buffers", "peak_bytes", "peak_at",
                                          "total")} | {"in_flight": [1], "pp_buffers": 0}
    pieces = micro_batch_pieces(shape, tp, micro, seq, dtype, sequence_parallel, recompute,
                                optimizer, dropout, device, fsdp and dtype == "bf16-autocast")
    stored = rank_stored(shape, tp, dtype, first, last, row["layers"], dp, dp_mode)
    grad_bytes = _dtype_bytes(dtype)[0]
    acts, grads, temporaries = [], [], []  # per stage of the rank, for one micro-batch
    for s in mine:
        n = len(blocks[s])
        acts.append(n * pieces["block"] + (pieces["embedding"] if s == 0 else 0)
                    + (pieces["tail"] if s == S - 1 else 0))
        own = stage_tensors(shape, tp, s == 0, s == S - 1)["root"]
        # accumulated whole (FSDP2: unsharded, padded) until the last backward
        grads.append(grad_bytes * (_unsharded(own, dp, fsdp)
                                   + n * _unsharded(stored["block"], dp, fsdp)))
        temporaries.append(max(pieces["inside"], pieces["loss_backward"] if s == S - 1 else 0))
    tokens = shard_sizes(seq, tp)[0] if sequence_parallel else seq
    boundary = micro * tokens * shape.dim * ACTIVATION_BYTES
    pp_buffers = 0 if pp == 1 else micro_batches * boundary * (
        sum(s != 0 for s in mine) + sum(s != S - 1 for s in mine))
    dp_buffers = rank_dp_buffers(dtype, stored, row["layers"], dp, dp_mode, pp)
    moment = replay_peak(schedule_ops(pp, virtual, micro_batches, rank), acts, grads,
                         temporaries)
    step_peak = moment["bytes"] + pieces["rope"] + pp_buffers + dp_buffers
    optimizer_peak = stored["grads"] + step_temporaries(optimizer, stored["local"],
                                                        stored["largest"])
    optimizer_peak += dp_buffers if dp_mode == "ddp" else 0  # FSDP2's are let go by then
    at = f"stage {mine[moment['stage']]} {moment['op']}"
    peak, at = max((step_peak, at), (optimizer_peak, "optimizer step"))
    return row | {"params_per_rank": stored["params"], "weights": stored["weights"],
                  "grads": stored["grads"], "optimizer": stored["optimizer"],
                  "activations": moment["activations"], "in_flight": moment["in_flight"],
                  "pp_buffers": pp_buffers, "dp_buffers": dp_buffers, "peak_bytes": peak,
                  "peak_at": at, "total": stored["weights"] + stored["optimizer"] + peak}


def rank_stored(shape: ModelShape, tp: int, dtype: str, first: bool, last: bool, layers: int,
                dp: int = 1, dp_mode: str = "fsdp") -> dict:
    """What a pipeline rank of ``layers`` blocks stores between steps (``stage_tensors``):
    "params" (its elements), "weights", "grads" (at the optimizer step), "optimizer" (AdamW's
    states and step counts), and "local", "largest" (the elements its AdamW steps, the largest
    tensor of them: ``memory.step_temporaries``), "root" and "block" (its tensors); under FSDP2
    each its 1/dp share, as ``data_parallel.dp_memory`` counts it."""
    t = stage_tensors(shape, tp, first, last)
    stored, _, state_bytes = _dtype_bytes(dtype)
    params = _elements(t["root"]) + layers * _elements(t["block"])
    if dp > 1 and dp_mode == "fsdp":
        root, block = fsdp_elements(t["root"], dp), fsdp_elements(t["block"], dp)
        held = root["sharded"] + layers * block["sharded"]  # padded shards
        local = root["local"] + layers * block["local"]
        largest = max(root["largest"], block["largest"])
    else:
        held = local = params
        largest = max(d0 * row for _, d0, row in t["root"] + t["block"])
    n_tensors = len(t["root"]) + layers * len(t["block"])
    return {"params": params, "weights": stored * held, "grads": stored * held,
            "optimizer": state_bytes * local + 4 * n_tensors, "local": local,
            "largest": largest} | t


def rank_dp_buffers(dtype: str, stored: dict, layers: int, dp: int, dp_mode: str,
                    pp: int) -> int:
    """Data parallelism's buffers on a pipeline rank during the step: DDP's buckets (its
    gradients' size, the whole run); FSDP2's gathered weights (every block's with a pipeline,
    kept from its first forward to the end of the step; without one the root's, the block's in
    backward and the next one's) and one block's reduce-scatter input. None without dp."""
    stored_bytes, gathered, _ = _dtype_bytes(dtype)
    if dp == 1:
        return 0
    if dp_mode == "ddp":
        return stored_bytes * stored["params"]
    root = fsdp_elements(stored["root"], dp)["unsharded"]
    block = fsdp_elements(stored["block"], dp)["unsharded"]
    kept = root + (layers if pp > 1 else 2) * block
    return gathered * kept + stored_bytes * block


def replay_peak(ops: list[tuple[str, int]], acts: list[int], grads: list[int],
                temporaries: list[int]) -> dict:
    """The largest moment of a rank's schedule (``schedule_ops``): after each forward, the
    activations of the micro-batches in flight (``acts``: one micro-batch's, per local stage)
    and the gradients of every stage that has begun a backward (``grads``: they accumulate to
    the end of the step); at each backward, its stage's gradients too and the backward's
    ``temporaries``. Returns "bytes", "op" and "stage" (local) of that moment, "in_flight"
    (micro-batches per local stage) and "activations" then."""
    in_flight, started = [0] * len(acts), set()
    best = {"bytes": -1}
    for op, c in ops:
        if op == "F":
            in_flight[c] += 1
        else:
            started.add(c)
        held = sum(n * a for n, a in zip(in_flight, acts, strict=True))
        now = held + sum(grads[d] for d in started) + (temporaries[c] if op == "B" else 0)
        if now > best["bytes"]:
            best = {"bytes": now, "op": "forward" if op == "F" else "backward", "stage": c,
                    "in_flight": list(in_flight), "activations": held}
        if op == "B":
            in_flight[c] -= 1
    return best


def rank_tp_comm(shape: ModelShape, tp: int, layers: int, first: bool, last: bool, micro: int,
                 seq: int, micro_batches: int, sequence_parallel: bool, dtype: str,
                 recompute: str, bf16_params: bool) -> dict:
    """The TP collectives of a pipeline rank in a step (``comm.predicted_comm`` of a model of
    its ``layers`` blocks, one pass per micro-batch), less what other stages hold: the
    embedding's unless ``first``; the head's, the loss's and the final norm's SP weight
    gradient unless ``last``. As ``predicted_comm``: "counts", "bytes", "ring_bytes" per kind,
    "breakdown" rows."""
    rec = "full" if recompute == "full" else "none"
    comm = predicted_comm(dataclasses.replace(shape, n_layer=layers), micro, seq, tp,
                          sequence_parallel, "fp32" if dtype == "fp32" else "bf16", rec,
                          passes=micro_batches, bf16_params=bf16_params)
    rows = []
    for r in comm["breakdown"]:
        if r["source"] == "embedding" and not first:
            continue
        if r["source"].startswith(("LM head", "loss statistics")) and not last:
            continue
        if r["source"].startswith("norm weight grads") and not last:  # 2L + 1 -> 2L a pass
            each, ring = r["bytes"] // r["calls"], r["ring_bytes"] // r["calls"]
            calls = r["calls"] - micro_batches
            r = r | {"source": f"norm weight grads (x{2 * layers})", "calls": calls,
                     "bytes": calls * each, "ring_bytes": calls * ring}
        rows.append(r)
    return _totals(rows)


def _totals(rows: list[dict]) -> dict:
    total = {k: {kind: sum(r[k] for r in rows if r["kind"] == kind) for kind in KINDS}
             for k in ("calls", "bytes", "ring_bytes")}
    return {"counts": {k: v for k, v in total["calls"].items() if v},
            "bytes": {k: v for k, v in total["bytes"].items() if v},
            "ring_bytes": {k: v for k, v in total["ring_bytes"].items() if v}, "breakdown": rows}


def rank_dp_comm(shape: ModelShape, tp: int, dp: int, dp_mode: str, layers: int, first: bool,
                 last: bool, micro_batches: int, dtype: str, pp: int) -> dict:
    """The dp collectives of a pipeline rank in a step, as ``data_parallel.dp_comm`` counts
    them. Without a pipeline, ``dp_comm`` itself (each micro-batch a pass). With one: FSDP2
    gathers the root and each block once (kept to the end of the step) and reduce-scatters each
    once after the last backward; DDP all-reduces the rank's gradients once, in buckets as
    ``data_parallel.ddp_buckets`` fills them; the reported loss (one fp32 scalar) either way,
    and FSDP2's gradient norm (one more, and the partly owned K and V gradients gathered)."""
    stored, gathered, _ = _dtype_bytes(dtype)
    bf16_params = dtype == "bf16-autocast" and dp_mode == "fsdp"
    if pp == 1:
        return dp_comm(shape, tp, dp, dp_mode, stored, passes=micro_batches,
                       bf16_params=bf16_params)
    t = stage_tensors(shape, tp, first, last)
    rows = []

    def add(source, phase, kind, calls, payload):
        if dp > 1 and calls and payload:
            rows.append({"source": source, "phase": phase, "kind": kind, "calls": calls,
                         "bytes": calls * payload,
                         "ring_bytes": calls * round(payload * ring_share(kind, dp))})

    if dp_mode == "fsdp":
        gather = gathered if bf16_params else stored
        root = fsdp_elements(t["root"], dp)["unsharded"]
        block = fsdp_elements(t["block"], dp)["unsharded"]
        add("root weights", "forward", "all_gather", 1, gather * root)
        add(f"block weights (x{layers})", "forward", "all_gather", layers, gather * block)
        add(f"block gradients (x{layers})", "backward", "reduce_scatter", layers, stored * block)
        add("root gradients", "backward", "reduce_scatter", 1, stored * root)
        add("grad norm", "step", "all_reduce", 1, 4)
        for name, d0, row in partly_owned(shape, tp):
            add(f"grad norm: {name.split('.', 1)[1]} gathered (x{layers})", "step",
                "all_gather", layers, stored * fsdp_elements([(name, d0, row)], dp)["unsharded"])
    else:
        for size, calls in _bucket_counts(t, layers, stored).items():
            add(f"gradient buckets of {size:,} B", "backward", "all_reduce", calls, size)
    add("loss (reported mean)", "step", "all_reduce", 1, 4)
    return _totals(rows)


def _bucket_counts(t: dict, layers: int, grad_bytes: int, first: int = 2**20,
                   cap: int = 25 * 2**20) -> dict[int, int]:
    """DDP's buckets of a pipeline rank's gradients, {bytes: how many}, filled in the order they
    are ready (head, final norm, blocks from the last, embedding) as
    ``data_parallel.ddp_buckets`` fills a whole model's."""
    root = {x[0].split(".")[0]: x for x in t["root"]}
    order = [root[k] for k in ("lm_head",) if k in root]
    order += [x for x in reversed(t["root"]) if x[0].startswith("norm.")]
    order += list(reversed(t["block"])) * layers
    order += [x for x in t["root"] if x[0].startswith(("embed.", "pos."))]
    buckets, size, limit = [], 0, first
    for _, d0, row in order:
        size += d0 * row * grad_bytes
        if size >= limit:
            buckets.append(size)
            size, limit = 0, cap
    buckets += [size] if size else []
    return {s: buckets.count(s) for s in sorted(set(buckets), reverse=True)}


def plan_pipeline(shape: ModelShape, tp: int, pp: int, batch: int, seq: int,
                  micro_batches: int, virtual: int = 1, dtype: str = "bf16",
                  sequence_parallel: bool = False, recompute: str = "none",
                  device_memory: float | None = None, reserve: float = 0.10,
                  optimizer: str = "fused", dropout: bool = False, device: str = "cpu",
                  dp: int = 1, dp_mode: str = "fsdp") -> dict:
    """A (tp, pp, dp) layout's step: "stages" (``rank_memory`` per pipeline rank, with "fits"
    against the device memory less ``reserve``), "worst" (the rank with the largest total),
    "bubble", "p2p" (per rank, and the step's "sends"), "comm" (per rank, bytes each rank sends
    on its tp, pp and dp groups: ring bytes for the collectives), and the layout's numbers.
    ``batch`` is the step's, split over dp copies and then into ``micro_batches``."""
    check_step(dtype, recompute, batch, dp, dp_mode)
    if micro_batches >= 1 and (batch // dp) % micro_batches:
        raise ValueError(f"--micro-batches {micro_batches} does not divide the {batch // dp} "
                         "sequences of each data-parallel copy (--batch / --dp)")
    check_pipeline(pp, virtual, shape.n_layer, micro_batches)
    head_layout(shape.n_head, shape.n_kv_head, tp, 0)  # raises for a TP size the heads refuse
    if sequence_parallel and seq < tp:
        raise ValueError(f"--seq {seq} is shorter than --tp {tp}: sequence parallelism needs at "
                         "least one token per rank")
    micro = batch // dp // micro_batches
    S = pp * virtual
    usable = None if device_memory is None else round(device_memory * (1 - reserve))
    stages, comm, sends = [], [], []
    cache: dict[tuple, tuple] = {}
    for rank in range(pp):
        mine = rank_stages(pp, virtual, rank)
        row = rank_memory(shape, tp, pp, virtual, micro_batches, rank, micro, seq, dtype,
                          sequence_parallel, recompute, optimizer, dropout, device, dp, dp_mode)
        if usable is not None:
            row |= {"usable": usable, "fits": row["total"] <= usable}
        stages.append(row)
        key = (row["layers"], 0 in mine, S - 1 in mine)
        if key not in cache:
            cache[key] = (
                rank_tp_comm(shape, tp, *key, micro, seq, micro_batches, sequence_parallel,
                             dtype, recompute, dtype == "bf16-autocast" and dp > 1
                             and dp_mode == "fsdp"),
                rank_dp_comm(shape, tp, dp, dp_mode, *key, micro_batches, dtype, pp))
        tp_c, dp_c = cache[key]
        sent = p2p(pp, virtual, micro_batches, rank, micro, seq, shape.dim, tp,
                   sequence_parallel)
        sends.append(sent)
        tied = tied_sync(shape, tp, pp, rank, 0, dp, dp > 1 and dp_mode == "fsdp",
                         _dtype_bytes(dtype)[0])["bytes"].get("all_reduce", 0)
        comm.append({"tp": sum(tp_c["ring_bytes"].values()), "pp": sent["bytes"] + tied,
                     "dp": sum(dp_c["ring_bytes"].values()), "tp_counts": tp_c["counts"],
                     "dp_counts": dp_c["counts"]})
    worst = max(stages, key=lambda r: r["total"])
    return {"model": shape.name, "tp": tp, "pp": pp, "dp": dp, "virtual": virtual,
            "dp_mode": dp_mode if dp > 1 else None,
            "schedule": "1F1B" if virtual == 1 else "interleaved 1F1B",
            "micro_batches": micro_batches, "micro_batch": micro, "batch": batch, "seq": seq,
            "dtype": dtype, "sequence_parallel": sequence_parallel, "recompute": recompute,
            "device": device, "stages": stages, "worst": worst["stage"],
            "total": worst["total"], "usable": usable,
            "fits": None if usable is None else worst["total"] <= usable,
            "bubble": bubble(pp, virtual, micro_batches),
            "p2p": {"per_rank": sends, "sends": sum(s["activations"] + s["gradients"]
                                                    for s in sends),
                    "bytes": sum(s["bytes"] for s in sends)},
            "comm": comm}


def step_flops(shape: ModelShape, batch: int, seq: int, recompute: str = "none") -> float:
    """FLOPs of a training step: 6 per matmul weight and token (forward 2, backward 4; the head
    included, the embedding's lookup not), and attention's two (T x T) matmuls, 12·T·(h·hd) per
    token and block; a third more with full recomputation (the blocks' forward again)."""
    D, hd = shape.dim, shape.head_dim
    q, kv = shape.n_head * hd, shape.n_kv_head * hd
    block = D * (q + 2 * kv) + q * D + (3 if shape.gated_mlp else 2) * D * shape.hidden_dim
    tokens = batch * seq
    flops = 6 * tokens * (shape.n_layer * block + shape.vocab_size * D)
    flops += 12 * tokens * seq * q * shape.n_layer
    return flops * (4 / 3 if recompute == "full" else 1)


def step_seconds(flops_per_device: float, bubble_fraction: float, tp: int, pp: int, dp: int,
                 sends: dict) -> float:
    """The search's ranking proxy for a step's time: compute at ``DEVICE_FLOPS`` stretched by
    the bubble, plus the bytes a rank sends on each group ("tp", "pp", "dp") at
    ``NODE_BYTES_S`` when the group lies inside a node of ``GPUS_PER_NODE`` devices (the mesh
    is ("pp", "dp", "tp"): tp innermost) and ``NETWORK_BYTES_S`` when it spans nodes; no
    overlap."""
    span = {"tp": tp, "dp": tp * dp, "pp": tp * dp * pp}
    seconds = flops_per_device / DEVICE_FLOPS * (1 + bubble_fraction)
    for group, sent in sends.items():
        seconds += sent / (NODE_BYTES_S if span[group] <= GPUS_PER_NODE else NETWORK_BYTES_S)
    return seconds


def search_layouts(shape: ModelShape, devices: int, batch: int, seq: int,
                   device_memory: float, reserve: float = 0.10,
                   micro_batches: int | None = None, virtual: int = 1,
                   tps: list[int] | None = None, pps: list[int] | None = None,
                   **plan) -> dict:
    """Every (tp, pp, dp) layout of ``devices`` devices the model and schedules allow (module
    docstring), planned (``plan``: ``plan_pipeline``'s dtype, recompute, dp_mode, ...):
    "layouts" that fit, ranked by ``step_seconds``, each with its worst rank's peak, the bubble
    and the bytes that rank sends; "smallest", the layout with the lowest peak when none fits;
    "skipped", the layouts the schedules refuse, with the reason. ``micro_batches``: None, one
    sequence each (batch / dp); ``virtual`` applies to layouts with pp > 1; ``tps`` and ``pps``
    restrict the search."""
    if devices < 1:
        raise ValueError(f"--devices {devices} must be >= 1")
    usable = round(device_memory * (1 - reserve))
    candidates = [t for t in range(1, min(GPUS_PER_NODE, devices) + 1)
                  if devices % t == 0 and shape.n_head % t == 0 and (tps is None or t in tps)]
    rows, skipped = [], []
    flops = step_flops(shape, batch, seq, plan.get("recompute", "none")) / devices
    for tp in candidates:
        for pp in (p for p in range(1, devices // tp + 1) if (devices // tp) % p == 0):
            if pps is not None and pp not in pps:
                continue
            dp = devices // (tp * pp)
            v = virtual if pp > 1 else 1
            layout = {"tp": tp, "pp": pp, "dp": dp, "virtual": v}
            if batch % dp:
                skipped.append(layout | {"why": f"--batch {batch} does not split over dp {dp}"})
                continue
            m = micro_batches or batch // dp
            try:
                p = plan_pipeline(shape, tp, pp, batch, seq, m, v, device_memory=device_memory,
                                  reserve=reserve, dp=dp, **plan)
            except ValueError as e:
                skipped.append(layout | {"why": str(e)})
                continue
            sends = max(p["comm"], key=lambda c: c["tp"] + c["pp"] + c["dp"])
            rows.append(layout | {
                "micro_batches": m, "micro_batch": p["micro_batch"], "schedule": p["schedule"],
                "total": p["total"], "worst": p["worst"], "fits": p["fits"],
                "peak_at": p["stages"][p["worst"]]["peak_at"], "bubble": p["bubble"],
                "sends": {g: sends[g] for g in ("tp", "pp", "dp")},
                "step_seconds": step_seconds(flops, p["bubble"], tp, pp, dp,
                                             {g: sends[g] for g in ("tp", "pp", "dp")})})
    fits = sorted((r for r in rows if r["fits"]), key=lambda r: (r["step_seconds"], r["total"]))
    smallest = min(rows, key=lambda r: r["total"]) if rows else None
    return {"model": shape.name, "devices": devices, "batch": batch, "seq": seq,
            "device_memory": device_memory, "usable": usable, "layouts": fits,
            "smallest": None if fits else smallest, "planned": len(rows), "skipped": skipped}
