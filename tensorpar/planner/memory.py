"""Per-rank training memory: weights, gradients, AdamW states, activations; which TP size fits.

Two precisions of weights and optimizer (bytes per parameter P_rank on one rank):

- ``fp32``: weights 4, gradients 4, AdamW moments 8 = 16 B.
- ``bf16`` (Megatron-style mixed precision, as in ZeRO, Rajbhandari et al. 2020, section 3.1):
  bf16 weights 2 + bf16 gradients 2 + fp32 master weights 4 + fp32 moments 8 = 16 B/param
  (18 with Megatron's fp32 gradient buffer, ``accumulate_allreduce_grads_in_fp32``; we take 16).
- ``bf16-autocast`` (what ``tensorpar train --dtype bf16`` does): fp32 weights, gradients and
  moments (16 B) plus, during forward and backward, the bf16 copy of every matmul weight that
  autocast makes and the backward keeps (2 B per matmul parameter); activations in bf16 where
  autocast computes them (matmuls, attention), fp32 elsewhere (residual stream, norms, loss).
  Under FSDP2 the layers compute with bf16 gathered weights instead, and no copy is kept
  (``data_parallel.dp_memory`` takes them out); under DDP and without dp, as here.

Activations, two counts per rank (s = seq, b = batch, h = dim, a = heads, L layers, t = TP):

- ``paper``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 1-5, 16-bit activations with dropout masks, per layer::

      no TP           s·b·h·(34 + 5·a·s/h)
      TP              s·b·h·(10 + 24/t + 5·a·s/(h·t))
      TP + SP         s·b·h/t·(34 + 5·a·s/h)
      selective       the 5·a·s/h term dropped (attention scores recomputed)
      full            2·s·b·h per layer (s·b·h·2/t under SP): only each layer's input

- ``tensorpar``: the tensors tensorpar's GPT really keeps for backward, counted tensor by tensor
  (``activations.block_terms``): SwiGLU keeps gate and up pre-activations, silu(gate) and the
  product (4 hidden-sized tensors, not GELU's 2); PyTorch's fused SDPA kernels keep q, k, v, the
  output and a logsumexp per query, never the s x s scores (so selective recomputation saves
  nothing); no dropout masks at dropout 0; under autocast each block casts the rotary tables to
  bf16; the vocab-parallel loss keeps exp(logits - max) in one fp32 buffer (b·s·V/t: the fp32
  logits' own, or the fp32 copy of bf16 ones) and a few per-token statistics. Two kernels keep
  different tensors on CPU and CUDA (``device``): RMSNorm keeps only rstd besides its input on CUDA
  (torch's fused kernel) and on CPU in fp32 (``parallel.norm.rms_norm``), and x·rstd too under CPU
  autocast, where ``F.rms_norm`` is composed of ops; CUDA's memory-efficient attention (fp32's)
  returns a view of a (b, s, a, h/a) output, which the output projection reads as it is (after the
  CPU kernel, CUDA's flash and cuDNN's, bf16's on an H100, the projection's input is a copy).
  ``benchmarks/saved_activations.py`` prints a block's terms next to the tensors a real forward
  saves. The step's peak adds what is alive only for a moment: the loss backward's gradient of the
  logits (built in the loss's own buffer, plus its bf16 cast under autocast; with one rank, where
  the loss is ``F.cross_entropy``, two fp32 buffers of b·s·V), or a block's backward, or the
  optimizer step. It is checked against ``MemoryMeter`` around real steps: asserted within 10%
  on CPU (``tests/planner/test_plan.py``), measured within 1% on an H100 (torch 2.11,
  ``device="cuda"``, d=2048, 16 layers, B8 x T2048, fp32, bf16, unfused and recomputed).

A Hugging Face model converted by tensorpar (``converted``) keeps other attention tensors than
the GPT (``converted_block_terms``: K and V per KV head, no o_proj copy, the model's own rotary
tables; the math kernel on CUDA in fp32 with grouped KV heads). LoRA (``lora``, only on those
models) freezes the rest (``lora_block_terms``): no embedding output or first norm kept, no x·rstd
in the norms, no input of a row layer without an adapter, no weight gradients; a frozen block's
backward makes two or three hidden-sized gradients more than it keeps, and the final norm's
backward is a moment of its own. Against ``tensorpar train --hf --lora-rank`` on CPU (torch 2.13,
a random Llama, d=256, 4 layers, 8/4 heads, B8 x T128, TP 1 and 2, ranks 8 and 16, every
projection or q_proj,v_proj, fp32, bf16, SP, recomputed): measured within 0.5% in fp32, 1-4%
under bf16 autocast (``tests/planner/test_plan_lora.py`` asserts 10%); on chat examples, packed
(``Step.packed``) or not, LoRA and full fine-tunes, asserted within 5% at TP 2
(``tests/planner/test_plan_packed.py``); on an H200 (torch 2.11, transformers 5.17,
d=2048, 4 layers, 16/8 heads, B8 x T1024, ``--device cuda``, TP 1 and 2) within 3.5%.

Data parallelism (``tp_plan.plan_memory``'s dp and dp_mode: FSDP2's shards and gathered
blocks, DDP's buckets) builds on these numbers in ``data_parallel.py``.

``fits`` compares the total with the device memory less a reserve (default 10%: the allocator's
fragmentation and cache, the CUDA context and communication buffers, which no tensor count sees).
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar.planner.activations import PassSizes, block_terms, pass_sizes, rank_shapes
from tensorpar.planner.shapes import ModelShape, with_experts
from tensorpar.planner.step import ADAMW, DTYPES, RECOMPUTE, BlockBudget, Budget, Step
from tensorpar.transformer.attention import head_shards

__all__ = ["ADAMW", "DTYPES", "RECOMPUTE", "rank_shapes", "rank_params", "lora_params",
           "tensorpar_memory"]


def rank_params(shape: ModelShape, tp: int, rank: int = 0, ep: int = 1, ep_rank: int = 0) -> dict:
    """Parameter elements this rank holds: total, matmul weights (autocast copies them), the
    largest tensor (AdamW's temporaries), the count of tensors; MoE: ``experts.with_experts``."""
    s, D, hd = rank_shapes(shape, tp, rank), shape.dim, shape.head_dim
    qkv = (s["heads"] + 2 * s["kv_heads"]) * hd * D
    o = s["heads"] * hd * D
    mlp = (3 if shape.gated_mlp else 2) * s["hidden"] * D
    norm = D * (2 if shape.norm == "layer" else 1)
    bias = 0
    if shape.bias:
        bias = (s["heads"] + 2 * s["kv_heads"]) * hd + D + \
            (2 if shape.gated_mlp else 1) * s["hidden"] + D
    elif shape.qkv_bias:
        bias = (s["heads"] + 2 * s["kv_heads"]) * hd
    embed = s["vocab"] * D
    head = 0 if shape.tie_embeddings else embed
    block = qkv + o + mlp + 2 * norm + bias
    n_tensors = 2 + (shape.learned_pos > 0) + (not shape.tie_embeddings) + (shape.norm == "layer")
    linears = 7 if shape.gated_mlp else 6  # q, k, v, o, (gate,) up, down
    biases = linears if shape.bias else 3 if shape.qkv_bias else 0
    n_tensors += shape.n_layer * (linears + 2 * (1 + (shape.norm == "layer")) + biases)
    total = embed + head + shape.learned_pos * D + shape.n_layer * block + norm
    return with_experts({"total": total, "matmul": shape.n_layer * (qkv + o + mlp) + embed,
                         "largest": max(embed, qkv, s["hidden"] * D), "tensors": n_tensors,
                         "block": block}, shape, s, tp, rank, ep, ep_rank)  # matmul: head too


def adamw_temporaries(optimizer: str, total: int, largest: int) -> int:
    """Bytes AdamW's step allocates on top of its states, for fp32 parameters of ``total``
    elements, the largest of ``largest``: fused steps in place; foreach makes one temporary per
    parameter (the denominators); the single-tensor loop two of one parameter at a time."""
    if optimizer not in ADAMW:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(ADAMW)}")
    return {"fused": 0, "foreach": 4 * total, "for-loop": 2 * 4 * largest}[optimizer]


LORA_COLUMNS = ("q", "k", "v", "gate", "up")  # the GPT's names; a Hugging Face model's q_proj ...
LORA_ROWS = ("o", "down")


# a Hugging Face projection's name -> the planner's (GPT-2's c_proj is both o and down)
_HF_KINDS = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
             "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
             "c_attn": ("q", "k", "v"), "c_proj": ("o", "down"), "c_fc": ("up",)}


def planner_kinds(targets: str | None) -> tuple[str, ...] | None:
    """``--lora-targets`` (comma-separated projection names) as ``lora_params``' names (None:
    every projection)."""
    if targets is None:
        return None
    return tuple(k for t in targets.split(",") for k in _HF_KINDS.get(t.strip(), (t.strip(),)))


def lora_params(shape: ModelShape, tp: int, rank: int, r: int,
                targets: tuple[str, ...] | None = None) -> dict:
    """Adapter elements this rank holds for LoRA of rank ``r`` on the block projections
    ``targets`` (q, k, v, o, gate, up, down; default all): a column projection's A whole
    (r x D) and its share of B's rows, a row projection's share of A's columns and B whole
    (D x r) (``parallel/lora.py``). As ``rank_params``: total, largest, tensors, block; and
    ``columns``, ``rows``: how many of each kind a block adapts; ``o``, ``down``: whether those
    rows are; ``hidden``: the rank's MLP width."""
    s, D, hd = rank_shapes(shape, tp, rank), shape.dim, shape.head_dim
    out = {"q": s["heads"] * hd, "k": s["kv_heads"] * hd, "v": s["kv_heads"] * hd,
           "gate": s["hidden"] if shape.gated_mlp else 0, "up": s["hidden"]}
    ins = {"o": s["heads"] * hd, "down": s["hidden"]}
    chosen = set(targets or LORA_COLUMNS + LORA_ROWS)
    cols = [c for c in LORA_COLUMNS if c in chosen and out[c]]
    rows = [c for c in LORA_ROWS if c in chosen]
    block = sum(r * D + out[c] * r for c in cols) + sum(r * ins[c] + D * r for c in rows)
    sizes = [r * D] + [out[c] * r for c in cols] + [r * ins[c] for c in rows]
    return {"total": shape.n_layer * block, "block": block, "largest": max(sizes),
            "tensors": 2 * shape.n_layer * (len(cols) + len(rows)), "columns": len(cols),
            "rows": len(rows), "o": "o" in rows, "down": "down" in rows, "hidden": s["hidden"]}


def converted_block_terms(shape: ModelShape, tp: int, rank: int, terms: dict, N: int, B: int,
                          act: int, device: str = "cpu", attention: str | None = None,
                          masked: bool = False) -> dict:
    """``activations.block_terms`` (tensorpar's GPT) made what a block of a Hugging Face model
    converted by tensorpar (``hf/``) keeps: its attention keeps other tensors than the GPT's
    (measured tensor by tensor with ``saved_tensors_hooks``, torch 2.13 CPU, transformers 5, a
    random Llama of width 256, 8 heads, 4 KV heads, at TP 1 and 2):

    - K and V: transformers hands SDPA the rank's KV heads with ``enable_gqa`` (no attention
      mask and head_dim <= 256: ``use_gqa_in_sdpa``), so they are kept as they are, not one per
      query head as the GPT's index_select makes them; only a rank whose query heads do not map
      evenly onto its KV heads has the converter expand them first (``hf/styles.py``'s
      kv_index). (A mask, as packed examples give, makes transformers repeat K and V: not
      modelled.)
    - the o_proj input: transformers' q, k and v are (B, h, T, hd) views of the (B, T, h, hd)
      projections, so SDPA's output is laid out (B, T, h, hd) as well, and its
      ``transpose(1, 2).contiguous()`` and reshape hand o_proj a view of it: no copy.
    - the rotary tables: the model computes cos and sin once per forward, in the residual
      stream's dtype (fp32), and every layer's rotation saves those same two (``rope`` in
      ``tensorpar_memory``), not bf16 casts of its own under autocast.
    - on CUDA in fp32 (``attention`` None: the kernel torch picks), K and V handed over with
      ``enable_gqa`` leave no fused kernel (flash and cuDNN take no fp32, the memory-efficient
      kernel as many KV heads as query heads: torch 2.11), so torch runs its math kernel, which
      keeps q and K (expanded) scaled, V expanded and the softmax's (B, h, T, T) fp32 scores,
      and whose (B, h, T, hd) output the o_proj input copies (measured on an H200: d=2048,
      16/8 heads, B8 x T1024: 768 MiB kept by a forward's attention).
    """
    (h0, h1), (k0, k1), _ = head_shards(shape.n_head, shape.n_kv_head, tp, rank)
    hd, hl, kvl = shape.head_dim, h1 - h0, k1 - k0
    group = shape.n_head // shape.n_kv_head
    kv_index = [h // group - k0 for h in range(h0, h1)]  # the local KV head of each query head
    uniform = hl % kvl == 0 and kv_index == [i // (hl // kvl) for i in range(hl)]
    # enable_gqa (else K and V already per head)
    gqa = uniform and hd <= 256 and kvl < hl and not masked
    kv_heads = kvl if gqa else hl
    out = terms | {"sdpa q, k, v": N * hl * hd * act + 2 * N * kv_heads * hd * act,
                   "o_proj input": 0, "rotary tables": 0}
    if gqa and device == "cuda" and act == 4 and attention is None:  # the math kernel
        out |= {"sdpa q, k, v": 3 * N * hl * hd * 4, "sdpa output": 0, "sdpa logsumexp": 0,
                "o_proj input": N * hl * hd * 4, "sdpa scores": B * hl * (N // B) ** 2 * 4}
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def lora_block_terms(shape: ModelShape, terms: dict, N: int, Ns: int, act: int,
                     lora: dict) -> dict:
    """A block's terms (``converted_block_terms``) in a LoRA step, the model frozen:

    - each adapter keeps its A x, (B, T, r) on every rank (a row layer's partial sum), for B's
      gradient (``parallel/lora.py``), in autocast's dtype; under autocast the bf16 copies of
      the adapters' factors are kept too, beside those of the frozen weights.
    - the norms' weights are frozen, and x·rstd is needed only for a weight's gradient: an
      RMSNorm keeps rstd alone besides its input (the residual), on CPU under autocast too, where
      ``F.rms_norm`` is composed of ops (layer_norm's kernel keeps its mean and rstd either way).
    - a row layer without an adapter (o_proj, down_proj) keeps no input: its weight wants no
      gradient (``parallel/fused.py``'s fused_row). down's input is the MLP's product (SwiGLU's,
      or the activation's output), which nothing else keeps; o_proj's is SDPA's output, which
      SDPA keeps itself, but for the math kernel's copy (``converted_block_terms``).
      (The column ops keep their input whether adapted or not, as the head does.)
    """
    out = terms | {"adapters' A x": (lora["columns"] + lora["rows"]) * N * lora["r"] * act}
    if not lora["down"]:
        out["mlp"] -= N * lora["hidden"] * act
    if not lora["o"] and out["sdpa output"]:  # SDPA keeps its own output, o_proj a view of it
        out["o_proj input"] = 0
    if shape.norm == "rms":
        out["norms"] = 2 * Ns * 4
    if terms["weight copies"]:  # autocast
        out["weight copies"] += 2 * lora["block"]
        if lora.get("base_dtype") == "bf16":  # the frozen projections are bf16 already: only
            out["weight copies"] = 2 * lora["block"]  # the adapters' factors are cast
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def step_temporaries(optimizer: str, total: int, largest: int) -> int:
    """Bytes allocated on top of the gradients after backward: the gradient norm squares one
    gradient at a time (an fp32 temporary of the largest), then AdamW steps
    (``adamw_temporaries``); the larger of the two."""
    return max(4 * largest, adamw_temporaries(optimizer, total, largest))


@dataclass(frozen=True)
class Kept:
    """What a pass keeps for backward at the end of its forward on one rank, by piece: the
    embedding's output (and ids and mask at TP > 1), the blocks', the tail's (final norm, the
    head's input and bf16 copy, the logits' buffer, the loss statistics), the rotary tables;
    "copies" the autocast weight copies among them, "head_copy" the head's."""

    embed: int
    blocks: int
    final_norm: int
    head_copy: int
    logits: int
    loss: int
    rope: int
    copies: int
    first_norm: int  # LoRA: block 0's input norm keeps nothing (its output is kept instead)

    @property
    def tail(self) -> int:
        return self.final_norm + self.head_copy + self.logits + self.loss

    @property
    def total(self) -> int:
        return self.embed + self.blocks + self.tail + self.rope


def rank_lora(step: Step, rank: int) -> dict | None:
    """``lora_params``' count for ``step.lora`` on TP rank ``rank``, with "r" and "base_dtype"
    (what ``lora_block_terms`` reads); None without LoRA."""
    if step.lora is None:
        return None
    lo = step.lora
    return lora_params(step.shape, step.tp, rank, lo.rank, planner_kinds(lo.targets)) | \
        {"r": lo.rank, "base_dtype": lo.base_dtype}


def check_memory_step(step: Step) -> None:
    """ValueError for a step ``tensorpar_memory`` cannot plan: an unknown AdamW, a precision
    tensorpar does not train (Megatron-style bf16 is ``tp_plan.step_memory``'s)."""
    if step.optimizer not in ADAMW:
        raise ValueError(f"optimizer {step.optimizer!r}: expected one of {', '.join(ADAMW)}")
    if step.dtype not in ("fp32", "bf16-autocast"):
        raise ValueError(f"dtype {step.dtype!r}: tensorpar trains fp32 or bf16-autocast")


def pass_block_terms(step: Step, rank: int) -> dict:
    """One block's terms in a pass (``activations.block_terms``), as a converted Hugging Face
    model keeps them (``converted_block_terms``) and as LoRA does (``lora_block_terms``)."""
    z, lora = pass_sizes(step, rank), rank_lora(step, rank)
    terms = block_terms(step, rank)
    if step.is_converted:
        terms = converted_block_terms(step.shape, step.tp, rank, terms, z.N, z.B, z.act,
                                      step.device, step.attention, step.packed)
    if lora is not None:
        terms = lora_block_terms(step.shape, terms, z.N, z.Ns, z.act, lora)
    return terms


def stored_bytes(step: Step, rank: int) -> tuple[int, int, int]:
    """Weights, gradients (at the optimizer step) and AdamW states (exp_avg, exp_avg_sq, a step
    count each) of TP rank ``rank``: the model's, or with LoRA the adapters' gradients and
    states; ``--base-dtype bf16`` holds the frozen projections (an untied head too) in bf16."""
    shape, s, p, lora = step.shape, rank_shapes(step.shape, step.tp, rank), \
        rank_params(step.shape, step.tp, rank, step.ep), rank_lora(step, rank)
    trained = p if lora is None else lora  # what has gradients and AdamW states
    weights = 4 * (p["total"] + (0 if lora is None else lora["total"]))
    if lora is not None and lora["base_dtype"] == "bf16":
        weights -= 2 * (p["matmul"] - (s["vocab"] * shape.dim if shape.tie_embeddings else 0))
    return weights, 4 * trained["total"], 8 * trained["total"] + 4 * trained["tensors"]


def kept_at_forward_end(step: Step, rank: int, terms: dict) -> Kept:
    """What a pass keeps on TP rank ``rank`` at the end of its forward (``Kept``), from one
    block's ``terms``."""
    shape, z, lora = step.shape, pass_sizes(step, rank), rank_lora(step, rank)
    D, N, Ns, act, full = shape.dim, z.N, z.Ns, z.act, step.recompute == "full"
    embed = Ns * D * 4 + (N * 12 if step.tp > 1 else 0)  # output; local ids, ownership mask
    # LoRA: the embedding is frozen, so its output needs no gradient, and neither does the first
    # block's input norm (its weight frozen too): neither keeps anything (the vocab-parallel
    # embedding neither its ids nor its mask); the first tensor kept is that norm's output, for
    # block 0's adapted columns (its "columns" term). Recomputed, the output is still kept, as
    # block 0's checkpointed input.
    first_norm = 0
    if lora is not None and not full:
        embed, first_norm = 0, terms["norms"] // 2
    if shape.norm == "layer":
        final_norm = 2 * Ns * 4
    elif step.device == "cuda" or not step.autocast or lora is not None:  # rstd (frozen:
        final_norm = Ns * 4  # lora_block_terms)
    else:  # rstd; on CPU under autocast also x·rstd (see block_terms)
        final_norm = Ns * D * 4 + Ns * 4
    final_norm += (Ns if z.regather else N) * D * act  # the head's input
    # --base-dtype bf16 (LoRA): an untied head is held in bf16, and autocast makes no copy of it
    bf16_base = lora is not None and lora["base_dtype"] == "bf16"
    head_copy = z.local["vocab"] * D * 2 if step.autocast and not (
        bf16_base and not shape.tie_embeddings) else 0
    # the fp32 cos and sin tables (T, hd/2), which the blocks save in fp32 (or, recomputed,
    # keep as the checkpoints' inputs); under autocast they save their bf16 casts instead
    # ("rotary tables" in block_terms; under CP each block saves its own rows of them there)
    rows = z.B if step.packed else 1  # packed: tables per row, from its restarting positions
    rope = 0 if (step.autocast or step.cp > 1) and not full else 4 * rows * z.keys * shape.head_dim
    if step.is_converted:  # the model's cos and sin, (T, hd) fp32 each (converted_block_terms)
        rope = 0 if shape.learned_pos else 2 * rows * z.T * shape.head_dim * 4
    L = shape.n_layer
    if full:  # each block keeps only its input (the checkpoint's)
        blocks, copies = L * Ns * D * 4, head_copy
    else:
        blocks, copies = L * terms["total"] - first_norm, L * terms["weight copies"] + head_copy
    # the logits: the same fp32 (N, V_local) either way: at TP=1 F.cross_entropy's log_softmax
    # output (not the logits), at TP > 1 the vocab-parallel loss's exp(logits - max), in the
    # logits' buffer; the loss: local max, lse, local targets, two masks
    return Kept(embed, blocks, final_norm, head_copy, N * z.local["vocab"] * 4, N * 18 + 12, rope,
                copies, first_norm)


def loss_backward(step: Step, z: PassSizes, kept: Kept) -> int:
    """The loss backward's moment: the activations, and the gradient of the logits. The
    vocab-parallel loss builds it in place in the buffer it kept; F.cross_entropy (one rank)
    makes nll_loss's gradient and log_softmax's. Under autocast the gradient is then cast to
    bf16 for the head's matmuls."""
    V = z.local["vocab"]
    return kept.total + (2 * z.N * V * 4 if step.tp == 1 else 0) + \
        (z.N * V * 2 if step.autocast else 0)


def final_norm_backward(step: Step, z: PassSizes, kept: Kept) -> int:
    """A converted model's final norm's backward, after the head's, the peak at TP > 1 (where
    the loss backward adds nothing) and, under autocast, at TP = 1 too: a frozen block's
    backward adds little. The logits' buffer, the loss's statistics and the head's input are
    let go; the head's input gradient (fp32) is in, and the norm's backward makes its temporaries
    (measured, torch 2.13 CPU): tensorpar's CPU rms_norm (fp32) x·rstd, g·w and the input
    gradient; F.rms_norm composed of ops (CPU autocast) five of the width at its pow's backward
    (the mul's and the mean's gradients, pow's 2·x and its product, and the gradient through
    x·rstd); torch's kernels (CUDA's, layer_norm) the input gradient alone. A converted model's
    full fine-tune holds the head's weight gradient too (its norm's is of the width: left out);
    the GPT's is not modelled (the block's backward its measured peak)."""
    D, Ns = step.shape.dim, z.Ns
    head_input = (Ns if z.regather else z.N) * D * z.act
    if step.shape.norm == "rms" and step.device == "cpu":
        # (a full fine-tune's norm kept x·rstd: three of the width, measured)
        norm_temps = (5 if step.autocast and step.lora is not None else 3) * Ns * D * 4
    else:
        norm_temps = Ns * D * 4
    head_grad = 4 * z.local["vocab"] * D if step.lora is None else 0
    return kept.total - kept.logits - kept.loss - head_input + Ns * D * 4 + norm_temps + head_grad


def block_backward(step: Step, rank: int, terms: dict, kept: Kept) -> tuple[int, int, BlockBudget,
                                                                              BlockBudget]:
    """A block's backward: the last block's (L blocks' activations, the head's gradient, the
    incoming gradient and the MLP's hidden-sized gradients; under full recomputation the
    recomputed block too), or the first block's if larger (the gradients of L - 1 blocks in
    for their activations). Returns its bytes, the autocast copies in them, and the blocks'
    "between", "inside" and "kept" (``BlockBudget``) and their copies: what data parallelism
    (``data_parallel.dp_memory``) builds on."""
    shape, z, lora = step.shape, pass_sizes(step, rank), rank_lora(step, rank)
    D, N, Ns, act, H = shape.dim, z.N, z.Ns, z.act, z.local["hidden"]
    full = step.recompute == "full"
    weight_copies = terms["weight copies"]
    head_grad = 4 * z.local["vocab"] * D if lora is None else 0  # a frozen head has none
    between = kept.total - kept.tail + head_grad
    if lora is None:
        # a converted model's MLP (measured, torch 2.13 CPU): down's weight gradient lets go of
        # its input, the product, before the product's backward makes gate's and up's: two
        # hidden-sized gradients in flight beside the incoming one, not the GPT's three
        hidden_grads = (2 if step.is_converted else 3) * N * H * act + 2 * N * D * 4
    else:
        # a frozen MLP's backward (measured: its peak is inside down's and the SwiGLU product's
        # backward): the incoming gradient (N·D fp32) and three hidden-sized gradients in
        # flight, down's base op's and its adapter's gradients of the product and their sum,
        # or (down not adapted) the product's and mul's two, silu(gate)'s and up's; the
        # product, which down kept for its adapter's A, is let go once down's backward has run
        # (without an adapter down kept none: lora_block_terms)
        hidden_grads = N * D * 4 + (2 if lora["down"] else 3) * N * H * act
        if not full:  # the last block's output, kept by the final norm alone, is gone
            between -= Ns * D * 4
    if z.regather:  # the column op's input, gathered again for its weight gradients
        hidden_grads += N * D * act
    top = between + hidden_grads
    copies = kept.copies - kept.head_copy
    if full:
        # inside the recomputed block's MLP backward (measured: tests/planner/test_plan_modes.py):
        # the block's saved tensors are back, less its input (a checkpointed input already) and
        # the SwiGLU product, which down's backward has consumed; one gradient of the width
        # is in flight, not two; and the embedding's output is block 0's checkpointed input,
        # not a tensor of its own
        block_input = embed_output = Ns * D * 4
        swiglu_product, second_width_grad = N * H * act, N * D * 4
        if lora is not None:  # hidden_grads has the one gradient and the product let go
            swiglu_product = second_width_grad = 0
        top += terms["total"] - block_input - swiglu_product - second_width_grad - embed_output
        copies += weight_copies
    # that is the last block's backward (L blocks' activations, no block gradient yet); at the
    # first block's, L - 1 blocks' activations (or checkpointed inputs) have become gradients
    one_kept = Ns * D * 4 if full else terms["total"]
    blocks = BlockBudget(between, top - between, one_kept)
    block_copies = BlockBudget(kept.copies - kept.head_copy, copies - kept.copies + kept.head_copy,
                               0 if full else weight_copies)
    trained = rank_params(shape, step.tp, rank, step.ep) if lora is None else lora
    first = top + (shape.n_layer - 1) * (4 * trained["block"] - one_kept)
    if first > top:
        top = first
        if not full:
            copies -= (shape.n_layer - 1) * weight_copies
    return top, copies, blocks, block_copies


def optimizer_step(step: Step, rank: int, grads: int) -> int:
    """The optimizer step's moment: the gradients and the temporaries of the gradient norm and
    AdamW (``step_temporaries``)."""
    lora = rank_lora(step, rank)
    trained = rank_params(step.shape, step.tp, rank, step.ep) if lora is None else lora
    return grads + step_temporaries(step.optimizer, trained["total"], trained["largest"])


def tensorpar_memory(step: Step, rank: int = 0) -> Budget:
    """Bytes on TP ``rank`` for a steady-state training step of tensorpar's GPT, one pass of
    ``step.micro`` sequences without data parallelism (AdamW states exist; gradients are freed
    between steps): what it stores, keeps, and each moment's peak.

    ``step.lora``: LoRA fine-tuning, the model frozen; gradients and AdamW states are the
    adapters', no weight gradient of the model is made (the head's neither), the frozen
    embedding and norms keep less, a frozen block's backward makes fewer gradients, and each
    adapted projection keeps its (b, s, r) product for B's gradient (``lora_block_terms`` and
    the moments below). ``step.converted``: the model is a Hugging Face model converted by
    tensorpar, whose attention keeps other tensors than the GPT's (``converted_block_terms``).
    ``step.dtype``: "fp32" or "bf16-autocast" (tensorpar's bf16). ``step.recompute``: "none" or
    "full" ("selective" is "none" here: no s x s scores are kept anyway). ``step.optimizer``:
    how AdamW steps (``ADAMW``): "fused" (tensorpar's trainer, on CPU and CUDA) updates in
    place with no temporaries; "foreach" (torch's default on CUDA) keeps one fp32 temporary per
    parameter (the denominators); "for-loop" (torch's default on CPU) keeps two of the largest
    tensor. ``step.dropout``: the residual branches drop (a bool mask each is kept).
    ``step.keep_gathered_input``: under SP the column ops keep their gathered (B, T, D) input
    instead of their (B, T_r, D) shard. ``step.device``: where the step runs, "cpu" or "cuda"
    (``activations.DEVICES``): on CUDA, F.rms_norm is torch's fused kernel (it keeps its input
    and rstd, not x·rstd), and attention runs CUDA's kernels. ``step.attention``: the SDPA
    kernel (``activations.ATTENTION``); None: what torch picks on the device (CPU: its flash
    kernel; CUDA: cuDNN under bf16 autocast, as torch 2.11 does on an H100, whose output the
    o_proj input copies; memory-efficient in fp32, whose output it views). "flash" (bf16 where
    cuDNN is not picked) keeps what cuDNN keeps; "efficient" under bf16 one copy less.

    The budget's "peaks" hold every moment's bytes above weights and states, "copies" the bytes
    of autocast's bf16 weight copies each moment includes (what Megatron-style bf16 weights, and
    FSDP2's bf16 gathered ones, replace: ``data_parallel.dp_memory``).
    """
    check_memory_step(step)
    z = pass_sizes(step, rank)
    weights, grads, states = stored_bytes(step, rank)
    terms = pass_block_terms(step, rank)
    kept = kept_at_forward_end(step, rank, terms)
    peaks = {"loss backward": loss_backward(step, z, kept)}
    copies = {"activations": kept.copies, "loss backward": kept.copies, "optimizer step": 0}
    if step.is_converted:
        peaks["final norm backward"] = final_norm_backward(step, z, kept)
        copies["final norm backward"] = kept.copies - kept.head_copy
    top, copies["block backward"], blocks, block_copies = block_backward(step, rank, terms, kept)
    peaks["block backward"] = top
    peaks["optimizer step"] = optimizer_step(step, rank, grads)
    return Budget(step.dtype, weights, grads, states, kept.total, peaks, copies, blocks,
                  block_copies)
