"""Communication of one training step, predicted: per kind and by source; and the MLP split.

For tensorpar's GPT (``gpt/model.py``) the prediction is exact: it equals what
``CollectiveCounter`` measures around forward, backward and ``ownership.clip_grad_norm_`` (calls,
payload bytes, ring bytes per rank), as ``tests/planner/test_plan.py`` checks. With N = B·T
tokens, width D, TP size t > 1::

    per block   forward: attention g + MLP g      2 all-reduces of N·D   (Megatron: 2 per layer)
                backward: attention f + MLP f     2 all-reduces of N·D
                SP: each all-reduce becomes an all-gather + a reduce-scatter of the same N·D,
                and backward all-gathers again the N/t·D input shard attention's and the MLP's
                column side kept instead of the gathered input (Megatron; payload N·D in the
                matmuls' dtype; the GPT's ``keep_gathered_input`` option, which keeps the
                gathered input and skips it, is not planned here)
    embedding   forward g (SP: reduce-scatter; its backward all-gather; a converted Hugging
                Face model all-reduces it and splits at the first layer, ``hf/sequence.py``)
    LM head     backward f of the head's input (SP: all-gather forward, reduce-scatter and the
                re-gather of the kept shard backward)
    loss        1 all-gather of 2·t·N fp32 statistics (per token the logsumexp and the target
                logit of each rank's slice; the GPT passes the vocabulary size, so the shards'
                sizes do not travel and no all-reduce of the target logits is needed)
    grad norm   1 all-reduce of one fp32 scalar
    SP norms    backward: 1 all-reduce of each norm's weight gradient (2 per block + final)
    shared KV   backward: 1 all-reduce per block of the dense K and V weight gradient (fp32),
                when some KV head is held by several ranks (fewer KV heads than ranks)
    LoRA        ``lora`` (``lora_sites``): the base frozen, so no weight gradient of its own is
                summed (SP norms, row biases, shared KV, the embedding's backward), no
                column op re-gathers its input under SP unless it holds an adapter, and the
                first block's column ops before its first adapter take no input gradient
                (the embedding's output needs none); the adapters' own terms: ``lora_rows``
    recompute   each block's forward runs again in backward up to its last saved tensor: the
                attention's exit and the MLP's entry (SP: all-gather) run again, not the MLP's
                exit (non-reentrant checkpointing stops once every saved tensor is recomputed;
                a Hugging Face model's gradient checkpointing runs the MLP's exit again too, and
                so does the GPT with dropout, whose last saved tensor is the mask after that
                exit: ``ModelShape.recompute_block_exit``); under SP the recomputed column side
                still re-gathers its shard in its backward. These are eager counts (what the
                trainer's summary measures): compiled, the partitioner picks what it recomputes

Context parallelism (``cp_comm``): the K/V all-gather forward and the reduce-scatter of their
gradients backward, per layer and pass; under CP the TP collectives above carry the rank's
tokens (``Step.rank_seq``), the whole sequence's never.

Payload is the full tensor (Megatron's b·s·h); ring bytes per rank are 2(t-1)/t of it for an
all-reduce, (t-1)/t for the others. ``dtype="bf16"`` is tensorpar's bf16 training (autocast, fp32
master weights): the row layers' outputs (forward g) and the re-gathered input shards travel in
bf16, input gradients in fp32 (the residual stream stays fp32), loss statistics and weight
gradients in fp32. ``bf16_params`` is that under FSDP2's ``MixedPrecisionPolicy`` (``tensorpar train
--dtype bf16 --dp-mode fsdp``): the forward sees bf16 weights, so the embedding's output, the
residual stream, the normed activations and every gradient of backward are bf16, and so travel;
so do the weight gradients reduced over TP inside backward (SP norms, shared KV: the unsharded
gradients are bf16 until FSDP2 reduce-scatters them in fp32); the loss statistics and the
gradient norm stay fp32.
"""

from __future__ import annotations

from tensorpar.parallel.context import cp_sizes
from tensorpar.planner.shapes import ModelShape
from tensorpar.runtime.counting import KINDS, ring_share
from tensorpar.transformer.attention import head_shards


def totals(rows: list[dict]) -> dict:
    """Rows {source, phase, kind, calls, bytes, ring_bytes} summed per kind, as
    ``CollectiveCounter`` counts them: {"counts", "bytes", "ring_bytes"} (kinds with none left
    out) and the rows as "breakdown"."""
    total = {k: {kind: sum(r[k] for r in rows if r["kind"] == kind) for kind in KINDS}
             for k in ("calls", "bytes", "ring_bytes")}
    return {"counts": {k: v for k, v in total["calls"].items() if v},
            "bytes": {k: v for k, v in total["bytes"].items() if v},
            "ring_bytes": {k: v for k, v in total["ring_bytes"].items() if v}, "breakdown": rows}


def _check_comm(seq: int, tp: int, sequence_parallel: bool, dtype: str, recompute: str,
                bf16_params: bool) -> None:
    """ValueError for a step ``predicted_comm`` cannot count."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype {dtype!r}: expected fp32 or bf16")
    if bf16_params and dtype != "bf16":
        raise ValueError("bf16_params: bf16 weights go with dtype bf16")
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute {recompute!r}: tensorpar's GPT has none or full")
    if sequence_parallel and seq < tp:
        raise ValueError(f"--seq {seq} is shorter than --tp {tp}: sequence parallelism needs at "
                         "least one token per rank")


class _TPRows:
    """The rows of a step's TP collectives as they are added: the region entries and exits of
    Megatron's f and g (all-reduces, or under SP all-gathers and reduce-scatters of the
    (B, T, D) activations, ``act`` elements, uneven shards padded), each made once a pass but
    for the step's own."""

    def __init__(self, tp: int, passes: int, sp: bool, act: int, res_b: int, out_b: int):
        self.rows: list[dict] = []
        self.t, self.passes, self.sp, self.act = tp, passes, sp, act
        self.res_b, self.out_b = res_b, out_b

    def add(self, source: str, phase: str, kind: str, calls: int, payload: int) -> None:
        if self.t == 1 or calls == 0:
            return
        calls *= 1 if phase == "step" else self.passes
        self.rows.append({"source": source, "phase": phase, "kind": kind, "calls": calls,
                          "bytes": calls * payload,
                          "ring_bytes": calls * round(payload * ring_share(kind, self.t))})

    def exit_region(self, source: str, phase: str, calls: int, dtype_bytes: int,
                    extra: int = 0) -> None:
        self.add(source, phase, "reduce_scatter" if self.sp else "all_reduce", calls,
                 self.act * dtype_bytes + extra)

    def exit_backward(self, source: str, calls: int, dtype_bytes: int) -> None:
        if self.sp:  # the reduce-scatter's backward all-gathers the gradient
            self.add(source, "backward", "all_gather", calls, self.act * dtype_bytes)

    def enter_region(self, source: str, phase: str, calls: int) -> None:
        if self.sp:  # all-gather of the normed activations
            self.add(source, phase, "all_gather", calls, self.act * self.res_b)

    def enter_backward(self, source: str, calls: int, extra: int = 0) -> None:
        self.add(source, "backward", "reduce_scatter" if self.sp else "all_reduce", calls,
                 self.act * self.res_b + extra)

    def regather(self, source: str, calls: int) -> None:
        if self.sp:  # the kept shard, cast to the matmuls' dtype
            self.add(source, "backward", "all_gather", calls, self.act * self.out_b)


def predicted_comm(shape: ModelShape, batch: int, seq: int, tp: int,
                   sequence_parallel: bool = False, dtype: str = "fp32",
                   recompute: str = "none", passes: int = 1, bf16_params: bool = False,
                   lora: dict | None = None) -> dict:
    """Collectives of one step of tensorpar's GPT of ``shape`` (forward, backward, grad norm).

    passes: forward and backward passes of the step (gradient accumulation), ``batch``
    sequences each: their collectives are made once a pass, the gradient norm's once a step.
    bf16_params: the model computes with bf16 copies of its weights (FSDP2's mixed precision;
    with dtype "bf16"): see the module docstring. lora: LoRA fine-tuning of a converted Hugging
    Face model (``lora_sites``).

    Returns {"counts", "bytes", "ring_bytes"}: per kind (as ``CollectiveCounter``), and
    "breakdown": rows {source, phase, kind, calls, bytes, ring_bytes}; "minimum": Megatron's
    analytic activation volume (4 N·D per layer, payload) for comparison.
    """
    _check_comm(seq, tp, sequence_parallel, dtype, recompute, bf16_params)
    N, D, L, t, sp = batch * seq, shape.dim, shape.n_layer, tp, sequence_parallel
    out_b = 2 if dtype == "bf16" else 4  # the row layers' output under autocast
    # the residual stream, the normed activations, the gradients: fp32 but with bf16 weights
    res_b = 2 if bf16_params else 4
    # under SP uneven shards travel padded to the largest, ceil(seq / t) tokens each
    act = batch * (t * -(-seq // t) if sp else seq) * D
    r = _TPRows(t, passes, sp, act, res_b, out_b)
    if sp and shape.sp_embedding_all_reduce:  # the whole (B, T, D), then split: no padding
        r.add("embedding", "forward", "all_reduce", 1, N * D * res_b)
    else:
        r.exit_region("embedding", "forward", 1, res_b)
    if lora is None or lora["input_grad"]:  # the split's backward all-gathers as a scatter's
        r.exit_backward("embedding", 1, res_b)
    ride = {p: lora_riding(lora, p, N, out_b, res_b) if lora and not sp else (0, 0)
            for p in ("attention", "mlp")}
    # an MoE model: the MLP's collectives in its dense layers, and in its MoE layers those of
    # the shared experts (split as the MLP); the MoE layers' own are moe_comm's
    count = {"attention": L, "mlp": L if shape.moe is None else
             L - shape.moe.moe_layers(L) * (not shape.moe.shared_hidden)}
    for part in ("attention", "mlp"):
        Lp = count[part]
        # LoRA: the first block's ops before its first adapter take no input gradient, and
        # without SP the adapters' z and dz ride the rows' and columns' all-reduces
        first = lora["first_block"][part] if lora else {"dx": True, "dy": True}
        r.enter_region(f"{part} (x{Lp} blocks)", "forward", Lp)
        r.exit_region(f"{part} (x{Lp} blocks)", "forward", Lp, out_b, ride[part][0])
        r.enter_backward(f"{part} (x{Lp} blocks)", Lp - (not first["dx"]), ride[part][1])
        if lora is None or (lora["columns"][part] and not lora["dropout"]):  # A's gradient
            r.regather(f"{part} input re-gather (x{Lp} blocks)", Lp)
        r.exit_backward(f"{part} (x{Lp} blocks)", Lp - (not first["dy"]), out_b)
    if recompute == "full":
        r.enter_region("recompute: attention", "backward", L)
        r.exit_region("recompute: attention", "backward", L, out_b, ride["attention"][0])
        r.enter_region("recompute: mlp entry", "backward", count["mlp"])
        # LoRA under SP: the row layer's last saved tensors (A's input, z) come before its
        # reduce-scatter, so the recompute stops short of it (measured on a Llama)
        if shape.recompute_block_exit and not (sp and lora is not None):
            r.exit_region("recompute: mlp exit", "backward", count["mlp"], out_b,
                          ride["mlp"][0])
    if shape.moe is not None:
        moe_tp_rows(r.add, shape, N, D, sp, recompute, res_b)
    r.enter_region("LM head f", "forward", 1)
    r.enter_backward("LM head f", 1)
    if lora is None:  # a frozen head: no weight gradient, nothing to gather again
        r.regather("LM head input re-gather", 1)
    r.add("loss statistics", "forward", "all_gather", 1, 2 * t * N * 4)
    if sp and lora is None:
        norm_elems = D * (2 if shape.norm == "layer" else 1)
        r.add(f"norm weight grads (x{2 * L + 1})", "backward", "all_reduce", 2 * L + 1,
              norm_elems * res_b)
        if shape.bias:
            r.add(f"row bias grads (x{2 * L})", "backward", "all_reduce", 2 * L, D * res_b)
    if head_shards(shape.n_head, shape.n_kv_head, t, 0)[2] and lora is None:
        kv = 2 * shape.n_kv_head * shape.head_dim * (D + (shape.bias or shape.qkv_bias))
        r.add(f"shared KV grads (x{L})", "backward", "all_reduce", L, kv * res_b)
    if lora is not None:
        lora_rows(r.add, lora, shape, batch, seq, t, sp, recompute, out_b, res_b)
    r.add("grad norm", "step", "all_reduce", 1, 4)
    minimum = 2 * L * N * D * (out_b + res_b)
    return totals(r.rows) | {"minimum_block_bytes": minimum if t > 1 else 0}


def moe_tp_rows(add, shape: ModelShape, N: int, D: int, sp: bool, recompute: str,
                res_b: int) -> None:
    """An MoE layer's own TP collectives (``ParallelMoE``; its shared experts are the MLP's)
    through ``add``: without SP each TP rank routes its share of the tokens, so the outputs are
    all-gathered (forward, fp32: the routing weights are) and so are the input gradients
    (backward); the router's weight gradient (E x D fp32) is summed over TP (backward). The
    TP ranks are planned in one EP group (they hold different experts)."""
    layers = shape.moe.moe_layers(shape.n_layer)
    forward = 2 if recompute == "full" else 1
    if not sp:
        add(f"MoE outputs gathered (x{layers})", "forward", "all_gather", layers, N * D * 4)
        if forward == 2:
            add(f"recompute: MoE outputs gathered (x{layers})", "backward", "all_gather",
                layers, N * D * 4)
        add(f"MoE input grads gathered (x{layers})", "backward", "all_gather", layers,
            N * D * res_b)
    add(f"router grads (x{layers})", "backward", "all_reduce", layers,
        shape.moe.experts * D * 4)


def lora_sites(shape: ModelShape, r: int, targets: str | None = None,
               dropout: bool = False, input_grad: bool = False) -> dict:
    """LoRA of rank ``r`` on the block projections ``targets`` (``--lora-targets``, Hugging
    Face names; None: every projection) as the communication count sees it: per block the
    adapted column layers of the attention's and the MLP's column op (``columns``), whether
    their row layers are adapted (``rows``), the k and v adapters (``kv``: their B's rows are
    shared by ranks where KV heads are), whether the adapters drop their input, and which of
    the first block's ops take a gradient (``first_block``: the input gradient of its column
    op, "dx"; its row output's, "dy"), the embedding being frozen; ``input_grad``: its output
    takes a gradient all the same (transformers' gradient checkpointing makes it require one,
    ``enable_input_require_grads``: the trainer's ``--recompute``)."""
    gpt2 = shape.learned_pos > 0  # GPT-2's Conv1D: c_attn (q, k, v in one), c_fc, c_proj
    if gpt2:
        sites = {"c_attn": [("attention", "column")], "c_fc": [("mlp", "column")],
                 "c_proj": [("attention", "row"), ("mlp", "row")]}
    else:
        sites = {name: [(part, "column")] for part, names in
                 (("attention", ("q_proj", "k_proj", "v_proj")),
                  ("mlp", ("gate_proj", "up_proj") if shape.gated_mlp else ("up_proj",)))
                 for name in names} | {"o_proj": [("attention", "row")],
                                       "down_proj": [("mlp", "row")]}
    chosen = list(sites) if targets is None else [t.strip() for t in targets.split(",")]
    columns, rows = {"attention": 0, "mlp": 0}, {"attention": False, "mlp": False}
    for name in chosen:
        for part, kind in sites.get(name, []):
            if kind == "column":
                columns[part] += 1
            else:
                rows[part] = True
    first, grad = {}, input_grad  # whether the residual stream needs a gradient yet
    for part in ("attention", "mlp"):
        first[part] = {"dx": grad, "dy": grad or bool(columns[part]) or rows[part]}
        grad = first[part]["dy"]
    kv = 0 if gpt2 else sum(name in chosen for name in ("k_proj", "v_proj"))
    return {"r": r, "columns": columns, "rows": rows, "kv": kv, "dropout": dropout,
            "first_block": first, "input_grad": input_grad}


def lora_riding(lora: dict, part: str, N: int, out_b: int, res_b: int) -> tuple[int, int]:
    """Without SP, the bytes LoRA's ``part`` (attention or MLP) adds to the base's collectives
    of a block: z (N x r, the matmuls' dtype) in the row layer's forward all-reduce, and the
    column adapters' dz (N x r each, the input gradient's dtype) in the column op's
    input-gradient all-reduce, unless the adapters drop (A then leaves the op)."""
    z = N * lora["r"] * out_b if lora["rows"][part] else 0
    dz = 0 if lora["dropout"] else N * lora["r"] * lora["columns"][part] * res_b
    return z, dz


def lora_rows(add, lora: dict, shape: ModelShape, batch: int, seq: int, t: int, sp: bool,
              recompute: str, out_b: int, res_b: int) -> None:
    """The collectives of LoRA's own (``parallel/lora.py``) through ``add`` (predicted_comm's),
    beyond what rides the base's (``lora_riding``): per block,

        without SP   a column op whose input takes no gradient (the first block's first):
                     one all-reduce of its A's gradients (R x D); with dropout, each column
                     op's dz instead, (N x R) in the matmuls' dtype, through f's all-reduce
        under SP     each adapted column op: one all-reduce of its A's gradients; each adapted
                     row layer: one of its B's (D x r); with dropout, each column op's z
                     all-gathered (forward, and again when recomputed) and its dz
                     reduce-scattered, (N x R) padded as the activations
        shared KV    where ranks share KV heads, one all-reduce of the k and v adapters' dense
                     B (their rows summed over the ranks holding them)
    """
    L, D, r = shape.n_layer, shape.dim, lora["r"]
    N, padded = batch * seq, batch * (t * -(-seq // t) if sp else seq)
    drop = lora["dropout"]
    for part in ("attention", "mlp"):
        R = r * lora["columns"][part]
        if R and drop:
            if sp:
                add(f"LoRA {part} z (x{L} blocks)", "forward", "all_gather", L,
                    padded * R * out_b)
                add(f"LoRA {part} dz (x{L} blocks)", "backward", "reduce_scatter", L,
                    padded * R * out_b)
                if recompute == "full":
                    add(f"recompute: LoRA {part} z", "backward", "all_gather", L,
                        padded * R * out_b)
            else:
                add(f"LoRA {part} dz (x{L} blocks)", "backward", "all_reduce", L, N * R * out_b)
        own = L if sp else 0 if drop else int(not lora["first_block"][part]["dx"])
        if R and own:
            add(f"LoRA {part} A grads (x{own})", "backward", "all_reduce", own, R * D * res_b)
        if sp and lora["rows"][part]:
            add(f"LoRA {part} B grads (x{L})", "backward", "all_reduce", L, D * r * res_b)
    if lora["kv"] and head_shards(shape.n_head, shape.n_kv_head, t, 0)[2]:
        kv = lora["kv"] * shape.n_kv_head * shape.head_dim * r
        add(f"LoRA shared KV B grads (x{L})", "backward", "all_reduce", L, kv * res_b)


def mlp_split_comparison(batch: int, seq: int, dim: int, hidden: int, tp: int,
                         dtype_bytes: int = 2) -> list[dict]:
    """Forward + backward communication of gelu(X W1) W2 under the four ways to split W1, W2.

    X is (N, D) replicated on every rank, W1 (D, H), W2 (H, D), N = batch·seq, t = tp. The output
    Y and the input gradient dX must end complete on every rank. gelu needs complete
    pre-activations, so a split that leaves X W1 as partial sums must all-reduce N·H first::

        split              forward               backward              ring bytes per rank
        column-then-row    AR(N·D)               AR(N·D)               (t-1)/t ·  4 N·D
        row-then-column    AR(N·H) + AG(N·D)     AR(N·H) + AG(N·D)     (t-1)/t · (4 N·H + 2 N·D)
        column-then-column AG(N·H) + AG(N·D)     RS(N·H) + AR(N·D)     (t-1)/t · (2 N·H + 3 N·D)
        row-then-row       AR(N·H) + AR(N·D)     AG(N·H) + AG(N·D)     (t-1)/t · (3 N·H + 3 N·D)

    Column-then-row (Megatron) wins because W1 by columns gives each rank complete
    pre-activations for its H/t hidden units (gelu is local) and W2 by rows consumes exactly
    those units, leaving one partial (N, D) sum: nothing of size N·H ever moves, and H is
    usually 4 D (8/3 D with SwiGLU). Row splits of W1 make partial pre-activations (an N·H
    all-reduce before gelu); column splits of W2 need all of H on each rank (an N·H all-gather)
    and leave the output split by columns (an N·D all-gather). Returns rows sorted by ring bytes.
    """
    N, D, H, t = batch * seq, dim, hidden, tp
    nd, nh = N * D * dtype_bytes, N * H * dtype_bytes

    def ring(kind, payload):
        return round(payload * ring_share(kind, t)) if t > 1 else 0

    plans = {
        "column-then-row (Megatron)": [("forward", "all_reduce", nd),
                                       ("backward", "all_reduce", nd)],
        "row-then-column": [("forward", "all_reduce", nh), ("forward", "all_gather", nd),
                            ("backward", "all_reduce", nh), ("backward", "all_gather", nd)],
        "column-then-column": [("forward", "all_gather", nh), ("forward", "all_gather", nd),
                               ("backward", "reduce_scatter", nh), ("backward", "all_reduce", nd)],
        "row-then-row": [("forward", "all_reduce", nh), ("forward", "all_reduce", nd),
                         ("backward", "all_gather", nh), ("backward", "all_gather", nd)],
    }
    out = []
    for name, ops in plans.items():
        out.append({"split": name, "calls": len(ops) if t > 1 else 0,
                    "collectives": ", ".join(f"{p} {k} {b:,} B" for p, k, b in ops),
                    "bytes": sum(b for *_, b in ops) if t > 1 else 0,
                    "ring_bytes": sum(ring(k, b) for _, k, b in ops)})
    return sorted(out, key=lambda r: (r["ring_bytes"], r["calls"]))


def cp_comm(shape: ModelShape, batch: int, seq: int, tp: int, cp: int, dtype: str = "fp32",
            recompute: str = "none", passes: int = 1, layers: int | None = None,
            tp_rank: int = 0) -> dict:
    """The collectives of one training step on a rank's context-parallel group (the GPT under
    ``train --cp``), as ``CollectiveCounter`` counts them: per block and pass, one all-gather of
    the rank's K and V (stacked, each rank's chunks padded to the longest rank's count, the
    ``tensor_split`` of ``seq`` into 2·cp chunks) forward, and one reduce-scatter of their
    gradients backward; recomputed, the block's forward gathers them again. Payload: the
    gathered (2, B, kv_local, cp·longest, head_dim) tensor, in the activations' dtype (bf16
    under autocast). The loss's reductions run over dp x cp (``data_parallel.dp_comm`` with dp
    x cp ranks), not on this group. layers: the blocks the rank holds (default all; a pipeline
    rank's share)."""
    rows: list[dict] = []
    if cp > 1:
        (k0, k1) = head_shards(shape.n_head, shape.n_kv_head, tp, tp_rank)[1]
        head_dim = shape.head_dim or shape.dim // shape.n_head
        size = 2 if dtype != "fp32" else 4
        payload = 2 * batch * (k1 - k0) * cp * max(cp_sizes(seq, cp)) * head_dim * size
        blocks = (shape.n_layer if layers is None else layers) * passes
        gathers = blocks * (2 if recompute == "full" else 1)
        for phase, kind, calls in (("forward", "all_gather", blocks),
                                   ("backward", "reduce_scatter", blocks),
                                   ("recompute", "all_gather", gathers - blocks)):
            if calls:
                rows.append({"source": "attention K/V", "phase": phase, "kind": kind,
                             "calls": calls, "bytes": calls * payload,
                             "ring_bytes": calls * round(payload * ring_share(kind, cp))})
    return totals(rows)
