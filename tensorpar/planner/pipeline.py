"""Pipeline parallelism, planned: each pipeline rank's memory and the bytes it moves (point to
point, and its TP and dp collectives) in a step.

What ``tensorpar train --pp P`` runs (``train/pipeline.py``): the GPT's L blocks cut into
S = P·V stages as ``torch.tensor_split`` cuts L (consecutive, sizes differing by at most one,
the larger first), stage s on pipeline rank s % P (V = ``--pp-virtual`` stages per rank), the
embedding on stage 0, the final norm, head and loss on stage S - 1; the mesh is ("pp", "dp",
"tp"), the stages outermost. The m micro-batches are gradient accumulation's passes, each of
batch / (dp·m) sequences, run by torch's ``Schedule1F1B`` (V = 1) or
``ScheduleInterleaved1F1B`` (V > 1).

**Bubble and activations in flight**: ``schedule.py`` replays torch's schedule of a rank
(``schedule_ops``) and finds its largest moment (``replay_peak``); ``rank_memory`` takes it.

**A rank's memory** (``rank_memory``), built from the one-model planner's pieces of one
micro-batch (``tp_plan.step_memory`` at its batch; ``micro_batch_pieces``):

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
  pipeline (P = 1, accumulation only) ``tensorpar.mesh.data_parallel`` gathers the root, a block
  and the next one. DDP: its buckets, one more gradient-sized buffer for the whole run.
- the optimizer step: the gradients (FSDP2's sharded) and AdamW's temporaries.

P = 1 with one micro-batch is ``tp_plan.plan_memory``'s row itself.

**Point to point** (``p2p``): each stage boundary carries, per micro-batch, one activation
forward and one gradient backward, (micro, T, D) fp32 each (T/tp tokens under sequence
parallelism: each TP rank sends its own shard to the same TP rank of the next stage); a step
makes 2·m·(S - 1) sends; rank k sends m·(V - [k = P-1]) activations and m·(V - [k = 0])
gradients. A tied table adds, on the first and the last rank, one all-reduce of its gradient
(the rank's shard of it) over the two (``tied_sync``).

The search over (tp, pp, dp) layouts that fit a number of devices is ``search.py``.
"""

from __future__ import annotations

import dataclasses

from tensorpar.parallel.sharding import shard_sizes
from tensorpar.parallel.stages import check_pipeline, rank_stages, stage_blocks
from tensorpar.planner.activations import rank_shapes
from tensorpar.planner.comm import predicted_comm, totals
from tensorpar.planner.data_parallel import (
    dp_comm,
    fill_buckets,
    fsdp_elements,
    partly_owned,
    tensor_shapes,
)
from tensorpar.planner.memory import step_temporaries
from tensorpar.planner.schedule import bubble, replay_peak, schedule_ops
from tensorpar.planner.shapes import ModelShape
from tensorpar.planner.step import Step
from tensorpar.planner.tp_plan import check_shape, check_step, plan_memory, step_memory
from tensorpar.runtime.counting import ring_share

ACTIVATION_BYTES = 4  # the residual stream between stages: fp32, as the trainer declares it


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


def tied_sync(step: Step, rank: int, tp_rank: int = 0) -> dict:
    """The tied table's gradient sum on pipeline rank ``rank`` (TP rank ``tp_rank``, dp rank 0)
    in ``step``, as ``step_transfers`` counts: one all-reduce over the embedding group (the
    first and the last pipeline rank) of its (vocab / tp, D) shard's gradient, its dp rank's
    chunk of rows under FSDP2; nothing on a middle rank, for an untied head or without a
    pipeline."""
    shape, pp = step.shape, step.pp
    if pp == 1 or not shape.tie_embeddings or rank not in (0, pp - 1):
        return {"counts": {}, "bytes": {}}
    rows = shard_sizes(shape.vocab_size, step.tp)[tp_rank]
    rows = -(-rows // step.dp_ranks) if step.fsdp else rows  # FSDP2's first chunk
    grad_bytes = _dtype_bytes(step.dtype)[0]
    return {"counts": {"all_reduce": 1}, "bytes": {"all_reduce": rows * shape.dim * grad_bytes}}


def add_transfers(a: dict, b: dict) -> dict:
    """Two counts ({"counts": {kind: calls}, "bytes": {kind: payload}}) added."""
    return {k: {kind: a[k].get(kind, 0) + b[k].get(kind, 0) for kind in a[k].keys() | b[k].keys()}
            for k in ("counts", "bytes")}


def micro_batch_pieces(step: Step) -> dict:
    """Bytes one micro-batch of ``step.micro`` sequences keeps on TP rank 0, by piece, from the
    one-model planner (``tp_plan.step_memory`` of a one-block model): "block" (one block's kept
    tensors), "embedding" (the embedding's output, and its ids and mask at TP > 1: memory.py's
    embed term), "tail" (final norm, the head's input and bf16 copy, the logits' buffer, the loss
    statistics), "rope" (the rotary tables, once per rank), "inside" (what a block's backward
    adds), "loss_backward" (what the loss backward adds). The tail is what the model keeps
    beyond "between", which memory.py documents as the activations less the tail plus the head's
    fp32 gradient. Under FSDP2 with tensorpar's bf16 the layers compute with bf16 gathered
    weights, and no autocast copy of a weight is kept (as ``data_parallel.dp_memory`` takes
    them out)."""
    shape, tp, micro, seq = step.shape, step.tp, step.micro, step.rank_seq
    fsdp_bf16 = step.fsdp and step.dtype == "bf16-autocast"
    one = step.replace(shape=dataclasses.replace(shape, n_layer=1), batch=micro, dp=1,
                       micro_batches=1, pp=1, virtual=1)
    mem = step_memory(one)
    b, copies = mem.blocks, mem.block_copies

    def strip(key):
        return getattr(b, key) - (getattr(copies, key) if fsdp_bf16 else 0)

    activations = mem.activations - (mem.copies["activations"] if fsdp_bf16 else 0)
    head_grad = 4 * rank_shapes(shape, tp, 0)["vocab"] * shape.dim
    tail = activations - strip("between") + head_grad
    N = micro * seq
    Ns = micro * shard_sizes(seq, tp)[0] if step.sequence_parallel and tp > 1 else N
    embedding = Ns * shape.dim * 4 + (N * 12 if tp > 1 else 0)
    kept = strip("kept")
    return {"block": kept, "embedding": embedding, "tail": tail,
            "rope": activations - kept - tail - embedding, "inside": strip("inside"),
            "loss_backward": mem.peaks["loss backward"] - mem.activations}


def stage_tensors(shape: ModelShape, tp: int, first: bool, last: bool, ep: int = 1) -> dict:
    """TP rank 0's parameter tensors (name, dim 0, elements per row) of a pipeline rank: "root"
    (the embedding and a position table if it holds stage 0, the final norm and the head if it
    holds the last: a tied head is a copy of the embedding table) and "block" (one block's, as
    ``data_parallel.tensor_shapes``)."""
    t = tensor_shapes(shape, tp, 0, ep)
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


def rank_memory(step: Step, rank: int) -> dict:
    """Pipeline rank ``rank``'s bytes in ``step`` (``step.micro_batches`` micro-batches of
    ``step.micro`` sequences; TP rank 0, dp rank 0): weights, gradients, AdamW states, the
    activations in flight at the peak ("in_flight": micro-batches of each of its stages then),
    the point-to-point buffers ("pp_buffers"), data parallelism's ("dp_buffers": FSDP2's
    gathered weights and reduce-scatter buffer, DDP's buckets), "peak_bytes" at "peak_at" above
    the weights and states, and "total". The module docstring lists each term."""
    shape, pp, virtual = step.shape, step.pp, step.virtual
    S = pp * virtual
    mine = rank_stages(pp, virtual, rank)
    blocks = stage_blocks(shape.n_layer, S)
    first, last = 0 in mine, S - 1 in mine
    row = {"stage": rank, "stages": mine,
           "blocks": [f"{blocks[s].start}-{blocks[s].stop - 1}" for s in mine],
           "layers": sum(len(blocks[s]) for s in mine), "first": first, "last": last}
    if pp == 1 and step.micro_batches == 1:  # no pipeline, one pass: the one-model row itself
        one = plan_memory(step)
        return row | {k: one[k] for k in ("params_per_rank", "weights", "grads", "optimizer",
                                          "activations", "dp_buffers", "peak_bytes", "peak_at",
                                          "total")} | {"in_flight": [1], "pp_buffers": 0}
    pieces = micro_batch_pieces(step)
    stored = rank_stored(step, first, last, row["layers"])
    grad_bytes = _dtype_bytes(step.dtype)[0]
    acts, grads, temporaries = [], [], []  # per stage of the rank, for one micro-batch
    for s in mine:
        n = len(blocks[s])
        acts.append(n * pieces["block"] + (pieces["embedding"] if s == 0 else 0)
                    + (pieces["tail"] if s == S - 1 else 0))
        own = stage_tensors(shape, step.tp, s == 0, s == S - 1, step.ep)["root"]
        # accumulated whole (FSDP2: unsharded, padded) until the last backward
        grads.append(grad_bytes * (_unsharded(own, step.dp_ranks, step.fsdp)
                                   + n * _unsharded(stored["block"], step.dp_ranks, step.fsdp)))
        temporaries.append(max(pieces["inside"], pieces["loss_backward"] if s == S - 1 else 0))
    seq = step.rank_seq  # the CP rank's tokens
    tokens = shard_sizes(seq, step.tp)[0] if step.sequence_parallel else seq
    boundary = step.micro * tokens * shape.dim * ACTIVATION_BYTES
    pp_buffers = 0 if pp == 1 else step.micro_batches * boundary * (
        sum(s != 0 for s in mine) + sum(s != S - 1 for s in mine))
    dp_buffers = rank_dp_buffers(step, stored, row["layers"])
    moment = replay_peak(schedule_ops(pp, virtual, step.micro_batches, rank), acts, grads,
                         temporaries)
    step_peak = moment["bytes"] + pieces["rope"] + pp_buffers + dp_buffers
    optimizer_peak = stored["grads"] + step_temporaries(step.optimizer, stored["local"],
                                                        stored["largest"])
    optimizer_peak += dp_buffers if step.dp_mode == "ddp" else 0  # FSDP2's are let go by then
    at = f"stage {mine[moment['stage']]} {moment['op']}"
    peak, at = max((step_peak, at), (optimizer_peak, "optimizer step"))
    return row | {"params_per_rank": stored["params"], "weights": stored["weights"],
                  "grads": stored["grads"], "optimizer": stored["optimizer"],
                  "activations": moment["activations"], "in_flight": moment["in_flight"],
                  "pp_buffers": pp_buffers, "dp_buffers": dp_buffers, "peak_bytes": peak,
                  "peak_at": at, "total": stored["weights"] + stored["optimizer"] + peak}


def rank_stored(step: Step, first: bool, last: bool, layers: int) -> dict:
    """What a pipeline rank of ``layers`` blocks stores between steps (``stage_tensors``):
    "params" (its elements), "weights", "grads" (at the optimizer step), "optimizer" (AdamW's
    states and step counts), and "local", "largest" (the elements its AdamW steps, the largest
    tensor of them: ``memory.step_temporaries``), "root" and "block" (its tensors); under FSDP2
    each its 1/dp share, as ``data_parallel.dp_memory`` counts it."""
    t = stage_tensors(step.shape, step.tp, first, last, step.ep)
    stored, _, state_bytes = _dtype_bytes(step.dtype)
    params = _elements(t["root"]) + layers * _elements(t["block"])
    if step.fsdp:
        dp = step.dp_ranks
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


def rank_dp_buffers(step: Step, stored: dict, layers: int) -> int:
    """Data parallelism's buffers on a pipeline rank of ``layers`` blocks (``rank_stored``)
    during the step: DDP's buckets (its gradients' size, the whole run); FSDP2's gathered
    weights (every block's with a pipeline, kept from its first forward to the end of the step;
    without one the root's, the block's in backward and the next one's) and one block's
    reduce-scatter input. None without dp."""
    stored_bytes, gathered, _ = _dtype_bytes(step.dtype)
    dp = step.dp_ranks
    if dp == 1:
        return 0
    if step.dp_mode == "ddp":
        return stored_bytes * stored["params"]
    root = fsdp_elements(stored["root"], dp)["unsharded"]
    block = fsdp_elements(stored["block"], dp)["unsharded"]
    kept = root + (layers if step.pp > 1 else 2) * block
    return gathered * kept + stored_bytes * block


def rank_tp_comm(step: Step, layers: int, first: bool, last: bool) -> dict:
    """The TP collectives of a pipeline rank in a step (``comm.predicted_comm`` of a model of
    its ``layers`` blocks, one pass per micro-batch), less what other stages hold: the
    embedding's unless ``first``; the head's, the loss's and the final norm's SP weight
    gradient unless ``last``. FSDP2 under tensorpar's bf16 gathers bf16 weights. As
    ``predicted_comm``: "counts", "bytes", "ring_bytes" per kind, "breakdown" rows."""
    rec = "full" if step.recompute == "full" else "none"
    micro_batches = step.micro_batches
    comm = predicted_comm(dataclasses.replace(step.shape, n_layer=layers), step.micro,
                          step.rank_seq,
                          step.tp, step.sequence_parallel,
                          "fp32" if step.dtype == "fp32" else "bf16", rec,
                          passes=micro_batches,
                          bf16_params=step.dtype == "bf16-autocast" and step.fsdp)
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
    return totals(rows)


def rank_dp_comm(step: Step, layers: int, first: bool, last: bool) -> dict:
    """The dp collectives of a pipeline rank of ``layers`` blocks in a step, as
    ``data_parallel.dp_comm`` counts them. Without a pipeline, ``dp_comm`` itself (each
    micro-batch a pass). With one: FSDP2 gathers the root and each block once (kept to the end
    of the step) and reduce-scatters each once after the last backward; DDP all-reduces the
    rank's gradients once, in buckets as ``data_parallel.ddp_buckets`` fills them; the reported
    loss (one fp32 scalar) either way, and FSDP2's gradient norm (one more, and the partly
    owned K and V gradients gathered)."""
    shape, tp, dp = step.shape, step.tp, step.dp_ranks
    stored, gathered, _ = _dtype_bytes(step.dtype)
    bf16_params = step.dtype == "bf16-autocast" and step.dp_mode == "fsdp"
    if step.pp == 1:
        return dp_comm(shape, tp, dp, step.dp_mode, stored, passes=step.micro_batches,
                       bf16_params=bf16_params, ep=step.ep)
    t = stage_tensors(shape, tp, first, last, step.ep)
    rows = []

    def add(source, phase, kind, calls, payload):
        if dp > 1 and calls and payload:
            rows.append({"source": source, "phase": phase, "kind": kind, "calls": calls,
                         "bytes": calls * payload,
                         "ring_bytes": calls * round(payload * ring_share(kind, dp))})

    if step.dp_mode == "fsdp":
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
    return totals(rows)


def _bucket_counts(t: dict, layers: int, grad_bytes: int) -> dict[int, int]:
    """DDP's buckets of a pipeline rank's gradients, {bytes: how many}, filled in the order they
    are ready (head, final norm, blocks from the last, embedding) as
    ``data_parallel.ddp_buckets`` fills a whole model's."""
    root = {x[0].split(".")[0]: x for x in t["root"]}
    order = [root[k] for k in ("lm_head",) if k in root]
    order += [x for x in reversed(t["root"]) if x[0].startswith("norm.")]
    order += list(reversed(t["block"])) * layers
    order += [x for x in t["root"] if x[0].startswith(("embed.", "pos."))]
    buckets = fill_buckets(order, grad_bytes)
    return {s: buckets.count(s) for s in sorted(set(buckets), reverse=True)}


def plan_pipeline(step: Step, device_memory: float | None = None,
                  reserve: float = 0.10) -> dict:
    """A (tp, pp, dp) layout's step: "stages" (``rank_memory`` per pipeline rank, with "fits"
    against ``device_memory`` less ``reserve``), "worst" (the rank with the largest total),
    "bubble", "p2p" (per rank, and the step's "sends"), "comm" (per rank, bytes each rank sends
    on its tp, pp and dp groups: ring bytes for the collectives), and the layout's numbers.
    ``step.batch`` is the step's, split over dp copies and then into its micro-batches."""
    check_step(step)
    pp, virtual, m = step.pp, step.virtual, step.micro_batches
    if m >= 1 and (step.batch // step.dp) % m:
        raise ValueError(f"--micro-batches {m} does not divide the {step.batch // step.dp} "
                         "sequences of each data-parallel copy (--batch / --dp)")
    check_pipeline(pp, virtual, step.shape.n_layer, m)
    check_shape(step)
    S = pp * virtual
    usable = None if device_memory is None else round(device_memory * (1 - reserve))
    stages, comm, sends = [], [], []
    cache: dict[tuple, tuple] = {}
    for rank in range(pp):
        mine = rank_stages(pp, virtual, rank)
        row = rank_memory(step, rank)
        if usable is not None:
            row |= {"usable": usable, "fits": row["total"] <= usable}
        stages.append(row)
        key = (row["layers"], 0 in mine, S - 1 in mine)
        if key not in cache:
            cache[key] = (rank_tp_comm(step, *key), rank_dp_comm(step, *key))
        tp_c, dp_c = cache[key]
        sent = p2p(pp, virtual, m, rank, step.micro, step.rank_seq, step.shape.dim, step.tp,
                   step.sequence_parallel)
        sends.append(sent)
        tied = tied_sync(step, rank)["bytes"].get("all_reduce", 0)
        comm.append({"tp": sum(tp_c["ring_bytes"].values()), "pp": sent["bytes"] + tied,
                     "dp": sum(dp_c["ring_bytes"].values()), "tp_counts": tp_c["counts"],
                     "dp_counts": dp_c["counts"]})
    worst = max(stages, key=lambda r: r["total"])
    return {"model": step.shape.name, "tp": step.tp, "pp": pp, "dp": step.dp, "cp": step.cp,
            "virtual": virtual, "dp_mode": step.dp_mode if step.dp_ranks > 1 else None,
            "schedule": "1F1B" if virtual == 1 else "interleaved 1F1B",
            "micro_batches": m, "micro_batch": step.micro, "batch": step.batch, "seq": step.seq,
            "dtype": step.dtype, "sequence_parallel": step.sequence_parallel,
            "recompute": step.recompute, "device": step.device, "stages": stages,
            "worst": worst["stage"], "total": worst["total"], "usable": usable,
            "fits": None if usable is None else worst["total"] <= usable,
            "bubble": bubble(pp, virtual, m),
            "p2p": {"per_rank": sends, "sends": sum(s["activations"] + s["gradients"]
                                                    for s in sends),
                    "bytes": sum(s["bytes"] for s in sends)},
            "comm": comm}
