"""Data parallelism on top of TP, planned: per-rank memory and the dp group's communication.

What ``tensorpar.mesh.data_parallel`` builds: ``dp`` copies of the TP-sharded model, each step's
batch split over them, gradients averaged over the "dp" group, by torch's own engines. Under
context parallelism the cp ranks of a copy hold the same weights and sum their gradients with
the copies': the engine is planned over the dp x cp ranks (``Step.dp_ranks``; "dp" below), as
torchtitan's FSDP over dp x cp.

**FSDP2** (``fully_shard`` each block, then the root: embedding, final norm, LM head). Each rank
keeps 1/dp of its TP shard of every weight, gradient and AdamW state: each tensor's dim 0 is cut
into dp chunks of c = ceil(d0/dp) rows (``torch.chunk``); weights and gradients are stored padded
to c rows, AdamW states as the chunk itself (the last ranks' chunks may be shorter or empty).
Per step, with U_r and U_b the root's and a block's gathered bytes padded to dp·c rows, and R_r,
R_b the same at the gradients' width (the same numbers but under bf16, below)::

    forward    all-gather the root (kept to the end of backward: torch never reshards the root
               after forward), then each block, freed after its forward
    backward   all-gather each block again (the next one is prefetched while one runs), then
               reduce-scatter its gradients (R_b in, R_b/dp out); the root's last
    calls      all-gather 2L + 1 (payload U_r or U_b), reduce-scatter L + 1 (R_r or R_b)

Memory per rank, above the sharded weights and states, at each moment of the step (tensorpar's
activations of ``memory.tensorpar_memory`` for the rank's batch/dp sequences; "between" is the
backward between two blocks, ``blocks["between"]``)::

    loss backward          the TP plan's + U_r + U_b (the last block, prefetched)
    block i's backward     between - (L-1-i)·kept + inside + U_r + U_b (its own)
                           + U_b (block i-1 prefetched, i > 0) + R_b (block i+1's reduce-scatter
                           input, kept until the next reduce-scatter, i < L-1)
                           + (L-1-i)·R_b/dp (the later blocks' sharded gradients)
    block i's reduce-      between - (L-i)·kept + U_r + U_b (prefetched, i > 0) + 2 R_b (the
    scatter                gradients copied into the reduce-scatter input; gloo on CPU copies
                           that input again) + R_b/dp (its output, CPU) + (L-1-i)·R_b/dp
    embedding backward     U_r + the root's unsharded gradients (U_r's width; tied: + 2
                           embeddings, the two gradients of the shared table and their sum)
                           + U_b + L·R_b/dp
    root reduce-scatter    2 R_r + R_r/dp (CPU) + L·R_b/dp
    optimizer step         the sharded gradients + the temporaries of the gradient norm and
                           AdamW (``memory.step_temporaries``) of the sharded tensors

Under tensorpar's bf16 FSDP2 gathers bf16 copies of the fp32 shards (its
``MixedPrecisionPolicy``, ``tensorpar.mesh.data_parallel``) and the layers compute with them: the
activations are autocast's (the same tensors kept, the residual stream's saved in fp32 by the
norms) less autocast's bf16 weight copies, which nothing makes (``memory.tensorpar_memory``'s
"copies", taken out of each moment).
U_r and U_b, the gathered weights and the unsharded gradients, are then 2 B per element; R_r and
R_b, the reduce-scatter's input (the gradients cast to fp32), gloo's copy of it, its output and
the stored gradients, 4 B. Measured (TP=1 and 2 x DP=2, d=256, 4 layers, B8 x T64): the step's
peak falls by a sixth (44.2 -> 36.7 MiB at TP=1, 25.0 -> 20.6 at TP=2), planned within 3%.

**DDP** (``DistributedDataParallel``, gradient_as_bucket_view off): replicated weights, gradients
and states as without data parallelism, plus its buckets, one more gradient-sized buffer kept for
the whole run. Gradients are copied into the buckets as they become ready and each bucket is
all-reduced in place (calls: the buckets, payload: every gradient). From the second step the
buckets follow the order in which gradients became ready in the first: the first closes once it
holds 1 MiB, the next ones 25 MiB (``bucket_cap_mb``), a bucket taking whole tensors until it
reaches its limit.

DDP under tensorpar's bf16 is autocast's: the bf16 copy autocast makes of each weight is kept
for backward (2 B per matmul parameter, in the TP plan's activations), the buckets fp32.

Both: the trainer all-reduces the loss over dp to report it (one fp32 scalar); under FSDP the
gradient norm sums its squares over dp too (one more), and on a TP rank that holds a KV head
another rank owns besides one of its own it gathers that K and V gradient over dp first (2L
all-gathers, ``partly_owned``). Ring bytes per rank as in
``runtime.counting``: 2(dp-1)/dp of the payload for an all-reduce, (dp-1)/dp for the others.
Checked against ``MemoryMeter`` and ``CollectiveCounter`` in ``tests/planner/test_plan_dp.py``.
"""

from __future__ import annotations

from tensorpar.planner.activations import rank_shapes
from tensorpar.planner.comm import totals
from tensorpar.planner.memory import step_temporaries
from tensorpar.planner.shapes import ModelShape, moe_tensors
from tensorpar.planner.step import DP_MODES, Budget, Step
from tensorpar.runtime.counting import ring_share
from tensorpar.transformer.attention import head_shards

# DistributedDataParallel's defaults: torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, then
# bucket_cap_mb=25 (MiB)
DDP_FIRST_BUCKET = 2**20
DDP_BUCKET_CAP = 25 * 2**20


def check_dp(dp: int, mode: str) -> None:
    """ValueError, naming the flag, for a DP size below 1 or an unknown mode."""
    if dp < 1:
        raise ValueError(f"--dp {dp} must be >= 1")
    if mode not in DP_MODES:
        raise ValueError(f"--dp-mode {mode!r}: expected {' or '.join(DP_MODES)}")


def tensor_shapes(shape: ModelShape, tp: int, rank: int = 0, ep: int = 1,
                  ep_rank: int = 0) -> dict[str, list[tuple]]:
    """This TP rank's parameter tensors, (name, dim 0, elements per row), in the model's order:
    "root" (what ``fully_shard(model)`` holds: embedding, position table, final norm, LM head)
    and "block" (one block's; an MoE model's: an MoE block, EP rank ``ep_rank``'s experts,
    ``experts.moe_tensors``, also where a few layers keep a dense MLP)."""
    s, D, hd = rank_shapes(shape, tp, rank), shape.dim, shape.head_dim
    hl, kvl, H = s["heads"], s["kv_heads"], s["hidden"]
    layer = shape.norm == "layer"

    def norm(name):
        return [(f"{name}.weight", D, 1)] + ([(f"{name}.bias", D, 1)] if layer else [])

    def linear(name, out, inp, bias):
        return [(f"{name}.weight", out, inp)] + ([(f"{name}.bias", out, 1)] if bias else [])

    qkv_bias = shape.bias or shape.qkv_bias
    attention = linear("attn.q_proj", hl * hd, D, qkv_bias) + \
        linear("attn.k_proj", kvl * hd, D, qkv_bias) + \
        linear("attn.v_proj", kvl * hd, D, qkv_bias) + linear("attn.o_proj", D, hl * hd, shape.bias)
    mlp = (linear("mlp.gate", H, D, shape.bias) if shape.gated_mlp else []) + \
        linear("mlp.up", H, D, shape.bias) + linear("mlp.down", D, H, shape.bias)
    if shape.moe is not None:
        mlp = moe_tensors(shape, tp, rank, ep, ep_rank)
    block = norm("attn_norm") + attention + norm("mlp_norm") + mlp
    root = [("embed.weight", s["vocab"], D)]
    root += [("pos.weight", shape.learned_pos, D)] if shape.learned_pos else []
    root += norm("norm") + ([] if shape.tie_embeddings else [("lm_head.weight", s["vocab"], D)])
    return {"root": root, "block": block}


def fsdp_elements(tensors: list[tuple], dp: int, dp_rank: int = 0) -> dict[str, int]:
    """Elements of ``tensors`` under FSDP2 over ``dp`` ranks: "unsharded" (padded to dp·c rows,
    what an all-gather makes and a reduce-scatter takes), "sharded" (c rows each, the padded
    shard a rank stores), "local" (the rows of ``dp_rank``'s chunk, what AdamW's states copy),
    "largest" (the largest local tensor)."""
    out = {"unsharded": 0, "sharded": 0, "local": 0, "largest": 0}
    for _, d0, row in tensors:
        c = -(-d0 // dp)
        local = max(0, min(c, d0 - dp_rank * c)) * row
        out["unsharded"] += dp * c * row
        out["sharded"] += c * row
        out["local"] += local
        out["largest"] = max(out["largest"], local)
    return out


def ready_order(shape: ModelShape, tp: int, rank: int = 0, ep: int = 1) -> list[tuple]:
    """The parameter tensors in the order their gradients are complete in backward (DDP's
    buckets follow it): the LM head, the final norm, each block from the last (its MLP from the
    output side, then attention), then the embedding (a tied head's too: a table used twice is
    complete once both uses have given their gradient)."""
    t = tensor_shapes(shape, tp, rank, ep)
    root = {name.split(".")[0]: (name, d0, row) for name, d0, row in t["root"]}
    order = [root["lm_head"]] if "lm_head" in root else []
    order += [x for x in reversed(t["root"]) if x[0].startswith("norm.")]
    for _ in range(shape.n_layer):
        order += list(reversed(t["block"]))
    order += [x for x in t["root"] if x[0].startswith(("embed.", "pos."))]
    return order


def ddp_buckets(shape: ModelShape, tp: int, rank: int = 0, grad_bytes: int = 4,
                first: int = DDP_FIRST_BUCKET, cap: int = DDP_BUCKET_CAP,
                ep: int = 1) -> list[int]:
    """Bytes of each of DDP's gradient buckets in a steady step (after its rebuild in the first
    step), in order: tensors in ``ready_order`` fill a bucket until it holds ``first`` bytes,
    then each next until ``cap``; the rest make the last."""
    return fill_buckets(ready_order(shape, tp, rank, ep), grad_bytes, first, cap)


def fill_buckets(tensors: list[tuple], grad_bytes: int, first: int = DDP_FIRST_BUCKET,
                 cap: int = DDP_BUCKET_CAP) -> list[int]:
    """DDP's rule: (name, d0, row) gradients, in the order they are ready, fill a bucket until it
    holds ``first`` bytes, then each next until ``cap``; the rest make the last."""
    buckets, size, limit = [], 0, first
    for _, d0, row in tensors:
        size += d0 * row * grad_bytes
        if size >= limit:
            buckets.append(size)
            size, limit = 0, cap
    return buckets + ([size] if size else [])


def partly_owned(shape: ModelShape, tp: int, rank: int = 0) -> list[tuple]:
    """The K and V tensors of a block of which TP ``rank`` owns some rows but not all: a KV
    head held by several ranks belongs to the lowest (``parallel.ownership``), and this rank holds
    both such a head and one of its own. Under FSDP2 the gradient norm gathers their gradients
    over dp to cut its part (``ownership.clip_grad_norm_``)."""
    ranges = [head_shards(shape.n_head, shape.n_kv_head, tp, r)[1] for r in range(rank + 1)]
    (k0, k1), lower = ranges[rank], max([0] + [stop for _, stop in ranges[:rank]])
    if not k0 < lower < k1:
        return []
    return [x for x in tensor_shapes(shape, tp, rank)["block"]
            if x[0].startswith(("attn.k_proj", "attn.v_proj"))]


def dp_comm(shape: ModelShape, tp: int, dp: int, mode: str = "fsdp", param_bytes: int = 4,
            rank: int = 0, report_loss: bool = True, passes: int = 1,
            bf16_params: bool = False, ep: int = 1) -> dict:
    """Collectives TP ``rank`` issues on its dp group in one step, as ``comm.predicted_comm``
    returns the TP ones: {"counts", "bytes", "ring_bytes"} per kind (as ``CollectiveCounter``
    counts them), "breakdown" rows {source, phase, kind, calls, bytes, ring_bytes}. Nothing when
    dp is 1.

    param_bytes: the width of the weights gathered and gradients reduced: 4 for tensorpar's
    training, fp32 and bf16 alike (fp32 weights); 2 for Megatron-style bf16 weights.
    report_loss: the trainer's all-reduce of the loss over dp (one fp32 scalar). passes: forward
    and backward passes of the step (gradient accumulation): FSDP2 gathers the weights again in
    each, while the gradients are reduced once, with the last. bf16_params: FSDP2 gathers bf16
    copies of the weights (tensorpar's bf16: its ``MixedPrecisionPolicy``); the gradients are
    still reduced in ``param_bytes``. DDP: no effect. ep: an MoE model's routed experts split
    over ep ranks (the rank's share travels; planned on the dp group)."""
    check_dp(dp, mode)
    width, gather = param_bytes, 2 if bf16_params else param_bytes
    L, rows = shape.n_layer, []

    def add(source, phase, kind, calls, payload):
        if kind == "all_gather" and phase != "step":
            calls *= passes
        if dp > 1 and calls:
            rows.append({"source": source, "phase": phase, "kind": kind, "calls": calls,
                         "bytes": calls * payload,
                         "ring_bytes": calls * round(payload * ring_share(kind, dp))})

    t = tensor_shapes(shape, tp, rank, ep)
    if mode == "fsdp":
        root = fsdp_elements(t["root"], dp)["unsharded"]
        block = fsdp_elements(t["block"], dp)["unsharded"]
        add("root weights", "forward", "all_gather", 1, gather * root)
        add(f"block weights (x{L})", "forward", "all_gather", L, gather * block)
        add(f"block weights again (x{L})", "backward", "all_gather", L, gather * block)
        add(f"block gradients (x{L})", "backward", "reduce_scatter", L, width * block)
        add("root gradients", "backward", "reduce_scatter", 1, width * root)
        add("grad norm", "step", "all_reduce", 1, 4)
        for name, d0, row in partly_owned(shape, tp, rank):
            add(f"grad norm: {name.split('.', 1)[1]} gathered (x{L})", "step", "all_gather", L,
                width * fsdp_elements([(name, d0, row)], dp)["unsharded"])
    else:
        buckets = ddp_buckets(shape, tp, rank, width, ep=ep)
        for size in sorted(set(buckets), reverse=True):
            add(f"gradient buckets of {size:,} B", "backward", "all_reduce",
                buckets.count(size), size)
    if report_loss:
        add("loss (reported mean)", "step", "all_reduce", 1, 4)
    return totals(rows)


def accumulated(step: Step, mem: Budget, rank: int = 0) -> Budget:
    """``mem`` (one pass, ``memory.tensorpar_memory``) in a step of ``step.micro_batches``
    passes without sharded gradients (no data parallelism, or DDP, which accumulates in
    ``param.grad`` and all-reduces with the last pass): the gradients of the passes before the
    last are held through its backward. The loss backward (and LoRA's final norm backward) hold
    them besides what one pass has; a block's backward holds them all from its first moment,
    the head's among them (a pass's own gradients of the head and of the blocks before are
    added into them, not allocated), so the last block's backward is the largest. One pass:
    ``mem`` itself."""
    if step.micro_batches == 1:
        return mem
    head_grad = 0 if step.lora is not None else \
        4 * rank_shapes(step.shape, step.tp, rank)["vocab"] * step.shape.dim
    peaks = dict(mem.peaks)
    for moment in ("loss backward", "final norm backward"):
        if moment in peaks:
            peaks[moment] += mem.grads
    last_block = mem.blocks.between + mem.blocks.inside - head_grad + mem.grads
    peaks["block backward"] = max(peaks["block backward"], last_block)
    return mem.replace(peaks=peaks)


def dp_bytes(dtype: str) -> tuple[int, int]:
    """Bytes per element of the stored weights and gradients, and of AdamW's states: 4 and 8
    (fp32 and tensorpar's bf16, whose weights are fp32); 2 and 12 for Megatron-style bf16
    (with the fp32 master weights)."""
    return (2, 12) if dtype == "bf16" else (4, 8)


def dp_memory(step: Step, mem: Budget, rank: int = 0, dp_rank: int = 0) -> Budget:
    """Bytes on (TP ``rank``, ``dp_rank``) for a steady step under ``step``'s data parallelism
    (``step.dp`` copies, ``step.dp_mode``).

    mem: the step without data parallelism for this rank's batch/dp sequences, as
    ``memory.tensorpar_memory`` returns it (or ``tp_plan.step_memory``'s Megatron-style bf16
    version of it); its dtype "bf16-autocast" (tensorpar's bf16) under FSDP2 plans FSDP2's
    bf16 gathered weights (module docstring). The stored weights and gradients are 4 B wide
    (fp32 and tensorpar's bf16) or 2 (Megatron-style bf16), AdamW's states 8 B per element or
    12 (``dp_bytes``). ``step.device``: "cpu" (gloo copies a reduce-scatter's input) or
    "cuda". Returns the data-parallel step's budget, its "dp_buffers" DDP's buckets (held the
    whole run), or the gathered weights and reduce-scatter buffers at FSDP2's peak.
    """
    dp, mode = step.dp_ranks, step.dp_mode  # the CP ranks of a copy shard and sum with it
    check_dp(dp, mode)
    if dp == 1:
        return accumulated(step, mem, rank).replace(dp_buffers=0, held=0)
    shape, tp = step.shape, step.tp
    param_bytes, state_bytes = dp_bytes(step.dtype)
    t = tensor_shapes(shape, tp, rank, step.ep)
    if mode == "ddp":
        buckets = param_bytes * sum(d0 * row for _, d0, row in ready_order(shape, tp, rank,
                                                                             step.ep))
        return accumulated(step, mem, rank).replace(dp_buffers=buckets, held=buckets)
    root, block = fsdp_elements(t["root"], dp, dp_rank), fsdp_elements(t["block"], dp, dp_rank)
    L, b, peaks = shape.n_layer, mem.blocks, mem.peaks
    between, inside, kept = b.between, b.inside, b.kept
    # gathered weights and unsharded gradients: bf16 under tensorpar's bf16 (FSDP2's
    # MixedPrecisionPolicy), whose activations then hold no autocast weight copies; the
    # reduce-scatter, its output and the stored gradients are fp32 (param_bytes)
    mixed = mem.dtype == "bf16-autocast"
    if mixed:
        copies = mem.block_copies
        between, inside, kept = (between - copies.between, inside - copies.inside,
                                 kept - copies.kept)
        peaks = {k: v - mem.copies.get(k, 0) for k, v in peaks.items()}
    gather = 2 if mixed else param_bytes
    Ur, Ub = gather * root["unsharded"], gather * block["unsharded"]  # gathered
    Rr, Rb = param_bytes * root["unsharded"], param_bytes * block["unsharded"]  # reduced
    Urs, Ubs = param_bytes * root["sharded"], param_bytes * block["sharded"]
    cpu = step.device == "cpu"
    n_tensors = len(t["root"]) + L * len(t["block"])
    weights = grads = Urs + L * Ubs
    states = state_bytes * (root["local"] + L * block["local"]) + 4 * n_tensors
    # gradient accumulation: the passes before the last leave each block's gradients unsharded
    # (fp32), held until its reduce-scatter in the last pass's backward (torch holds FSDP2's
    # reduce-scatter back until then); the root's until its own
    acc = step.micro_batches > 1
    # each moment: (bytes above sharded weights and states, of which data parallelism's buffers)
    moments = {"loss backward": (peaks["loss backward"] + Ur + Ub + (Rr + L * Rb if acc else 0),
                                 Ur + Ub)}
    for i in range(L - 1, -1, -1):
        later = L - 1 - i
        prefetched = Ub if i > 0 else 0
        held = Rr + (i + 1) * Rb if acc else 0  # the root's, this block's and those below
        buf = Ur + Ub + prefetched + (Rb if later else 0) + later * Ubs
        moments[f"block {i} backward"] = (between - later * kept + inside + buf + held, buf)
        held = Rr + i * Rb if acc else 0
        buf = Ur + prefetched + 2 * Rb + (Ubs if cpu else 0) + later * Ubs
        moments[f"block {i} reduce-scatter"] = (between - (later + 1) * kept + buf + held, buf)
    embed = gather * t["root"][0][1] * t["root"][0][2]
    root_grads = gather * sum(d0 * row for _, d0, row in t["root"])
    buf = Ur + root_grads + (2 * embed if shape.tie_embeddings else 0) + Ub + L * Ubs
    buf += Rr if acc else 0
    moments["embedding backward"] = (buf, buf)
    buf = 2 * Rr + (Urs if cpu else 0) + L * Ubs
    moments["root reduce-scatter"] = (buf, buf)
    largest = max(root["largest"], block["largest"])
    step_bytes = grads + step_temporaries(step.optimizer, root["local"] + L * block["local"],
                                          largest)
    moments["optimizer step"] = (step_bytes, grads)
    peaks = {k: v for k, (v, _) in moments.items()}
    where = max(peaks, key=peaks.get)
    return mem.replace(weights=weights, grads=grads, optimizer=states,
                       dp_buffers=moments[where][1], peaks=peaks, held=0)
