"""What one transformer block keeps for backward, tensor by tensor, per device (under context
parallelism per CP rank: its tokens' share, the whole sequence's K and V, its queries' mask
against every key: ``cp_terms``).

The planner's activation model of tensorpar's GPT (``memory.tensorpar_memory`` adds the rest of the
step), and Korthikanti et al.'s formula it is shown against (``paper_activations``). ``block_terms``
names each term; ``benchmarks/saved_activations.py`` prints them next to the tensors a real forward
saves (``saved_tensors_hooks``), on CPU or on a GPU. Two kernels keep different tensors on CPU and
CUDA: RMSNorm (torch's fused CUDA kernel, and tensorpar's CPU one in fp32, keep its input and rstd
only; under CPU autocast it is composed of ops) and attention (CUDA's memory-efficient kernel, the
one fp32 gets, hands the output projection a view of its own output instead of a copy).
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar.parallel.sharding import shard_range, shard_sizes
from tensorpar.planner.shapes import ModelShape, moe_tensors
from tensorpar.planner.step import Step
from tensorpar.transformer.attention import head_shards

# where the step runs: the saved tensors of RMSNorm and attention differ (``block_terms``)
DEVICES = ("cpu", "cuda")
# torch's SDPA kernels, by what their backward keeps: "cpu" (the CPU flash kernel), CUDA's
# "flash", "efficient" (its output's storage doubles as the o_proj input) and "cudnn"; the math
# fallback, which keeps the s x s scores, is not modelled
ATTENTION = ("cpu", "flash", "efficient", "cudnn")


def block_copies(shape: ModelShape, s: dict) -> int:
    """The bf16 copies of one block's matmul weights that autocast makes and backward keeps."""
    D, hd, hl, kvl, H = shape.dim, shape.head_dim, s["heads"], s["kv_heads"], s["hidden"]
    return ((hl + 2 * kvl) * hd * D + hl * hd * D + (3 if shape.gated_mlp else 2) * H * D) * 2


def _attention_kernel(device: str, autocast: bool, attention: str | None) -> str:
    """The SDPA kernel the planner assumes: given, or the one torch picks for causal training
    attention without a mask (measured on torch 2.13 CPU and 2.11 CUDA on an H100)."""
    if attention is not None:
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: expected one of {', '.join(ATTENTION)}")
        return attention
    if device == "cpu":
        return "cpu"
    return "cudnn" if autocast else "efficient"  # flash and cuDNN take no fp32


@dataclass(frozen=True)
class PassSizes:
    """One pass of a step on one TP rank: ``micro`` sequences (B) of T tokens, N = B·T, Ns the
    rank's tokens under sequence parallelism (N/t; N without), "act" the bytes of an activation
    (2 under autocast, else 4), "regather" whether the column ops keep their input shard and
    gather it again in backward (SP without ``keep_gathered_input``), and the rank's local
    sizes (``rank_shapes``). Under context parallelism T is the CP rank's tokens of each
    sequence (the largest rank's: ``parallel.context.cp_sizes``) and ``keys`` the whole
    sequence, which its queries read (T without CP)."""

    B: int
    T: int
    N: int
    Ns: int
    act: int
    regather: bool
    local: dict
    keys: int = 0


def rank_shapes(shape: ModelShape, tp: int, rank: int) -> dict:
    """This rank's local sizes: query and KV heads, hidden units, vocabulary rows."""
    (h0, h1), (k0, k1), shared = head_shards(shape.n_head, shape.n_kv_head, tp, rank)
    v0, v1 = shard_range(shape.vocab_size, tp, rank)
    f0, f1 = shard_range(shape.hidden_dim, tp, rank)
    return {"heads": h1 - h0, "kv_heads": k1 - k0, "hidden": f1 - f0, "vocab": v1 - v0,
            "kv_identity": h1 - h0 == k1 - k0, "kv_shared": shared}


def pass_sizes(step: Step, rank: int = 0) -> PassSizes:
    """The sizes of one pass of ``step`` (``step.micro`` sequences) on TP rank ``rank`` (of
    the CP rank holding the most tokens)."""
    B, tp = step.micro, step.tp
    T = step.rank_seq  # the CP rank's tokens of each sequence (all of it without CP)
    N = B * T
    sp = step.sequence_parallel and tp > 1
    Ns = B * shard_sizes(T, tp)[rank] if sp else N  # its SP shard
    return PassSizes(B, T, N, Ns, 2 if step.autocast else 4,
                     sp and not step.keep_gathered_input, rank_shapes(step.shape, tp, rank),
                     step.seq)


def block_terms(step: Step, rank: int = 0) -> dict:
    """Bytes one block keeps for backward on TP rank ``rank`` in a pass of ``step``, term by
    term ("total": their sum). Under SP without ``keep_gathered_input`` the column ops keep
    their input shard (all-gathered again in backward). ``step.device``: "cpu" or "cuda" (see
    ``DEVICES``); ``step.attention``: the SDPA kernel (``ATTENTION``; None: the one torch picks
    there)."""
    shape, z = step.shape, pass_sizes(step, rank)
    device, autocast, act, N, Ns, B, s = (step.device, step.autocast, z.act, z.N, z.Ns, z.B,
                                          z.local)
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
    kernel = _attention_kernel(device, autocast, step.attention)
    D, hd = shape.dim, shape.head_dim
    hl, kvl, H = s["heads"], s["kv_heads"], s["hidden"]
    T = N // B
    t = {"residual": 2 * Ns * D * 4}  # the residual stream after attention and after the MLP
    if shape.norm == "layer":  # layer_norm: mean and rstd
        t["norms"] = 2 * (2 * Ns * 4)
    elif device == "cuda" or not autocast:  # torch's CUDA kernel, or on CPU in fp32 tensorpar's
        t["norms"] = 2 * Ns * 4  # (parallel.norm.rms_norm): the input (the residual) + rstd
    else:  # F.rms_norm on CPU under autocast, composed of ops: x·rstd (fp32) and rstd
        t["norms"] = 2 * (Ns * D * 4 + Ns * 4)
    # the column layers' input: the normed (SP: gathered) activations, in autocast's dtype; the
    # unfused path under autocast casts it once per projection
    n_cols_attn, n_cols_mlp = (1, 1) if step.fused or not autocast else \
        (3, 2 if shape.gated_mlp else 1)
    t["columns"] = (n_cols_attn + n_cols_mlp) * N * D * act
    if z.regather:  # one shard per column op, cast once to the matmul dtype
        t["columns"] = 2 * Ns * D * act
    q = N * hl * hd * act
    if s["kv_identity"]:  # k and v read directly: the rotated k and the projection's v
        kv = 2 * N * kvl * hd * act
    else:  # index_select makes one K and V per query head
        kv = 2 * N * hl * hd * act
    t["sdpa q, k, v"] = q + kv  # the rotated q, k (index_selected), v
    t["sdpa output"] = q
    # CUDA's memory-efficient kernel writes the output as (B, T, h, hd) and returns its
    # (B, h, T, hd) transpose: the o_proj input (B, T, h·hd) is a view of it. After the CPU
    # kernel, CUDA's flash and cuDNN's the reshape copies (measured, torch 2.11 on an H100).
    t["o_proj input"] = 0 if kernel == "efficient" else q
    t["sdpa logsumexp"] = B * hl * T * 4
    # under autocast each apply_rotary casts the fp32 cos and sin tables (T, hd/2) to bf16, for
    # q and for k: four copies per block (in fp32 the shared table is used as it is)
    # (packed rows: tables per row, (B, T, hd/2), from each row's positions)
    t["rotary tables"] = 4 * (B if step.packed else 1) * T * (hd // 2) * 2 if autocast else 0
    if step.cp > 1:
        t |= cp_terms(step, z)
    t["mlp"] = (4 if shape.gated_mlp else 2) * N * H * act  # gate, up, silu(gate), the product
    # autocast: the bf16 weight copies; fp32: the layers save the parameters themselves
    t["weight copies"] = block_copies(shape, s) if autocast else 0
    if shape.moe is not None:  # an MoE layer instead of the MLP (every layer planned as one)
        t |= moe_terms(step, rank, N, Ns, act)
    t["dropout masks"] = 2 * Ns * D if step.dropout else 0  # two residual branches, 1 B each
    # packed rows: SDPA turns the block-diagonal (B, 1, T, T) bool mask into an additive one in
    # q's dtype, which it keeps, one per block (the same on every TP rank: it spans no heads);
    # under CP a mask always, the rank's T_i queries against all T keys, one for every row
    # unless packed ((1, 1, T_i, T): ``cp_attention_mask``)
    masked = step.packed or step.cp > 1
    t["attention mask"] = (B if step.packed else 1) * T * z.keys * act if masked else 0
    t["total"] = sum(t.values())
    return t


def cp_terms(step: Step, z: PassSizes) -> dict:
    """Under context parallelism (``transformer/context_parallel.py``, measured with
    ``saved_tensors_hooks``, torch 2.13 CPU): the rank's queries (T_i tokens of each row) read
    the keys and values of the whole sequence, all-gathered over the CP group: SDPA keeps K and
    V at full length (one per query head where the GQA heads are repeated, as without CP); and
    each layer takes its rows of the rotary tables, (T_i, hd/2) fp32 each for q's and k's
    rotation (their bf16 casts under autocast, as without CP: four per block). The mask is
    ``block_terms``' "attention mask"."""
    s, hd, act = z.local, step.shape.head_dim, z.act
    kv_heads = s["kv_heads"] if s["kv_identity"] else s["heads"]
    q = z.N * s["heads"] * hd * act
    out = {"sdpa q, k, v": q + 2 * z.B * z.keys * kv_heads * hd * act}
    rows = z.B if step.packed else 1
    out["rotary tables"] = 4 * rows * z.T * (hd // 2) * 2  # 2 fp32 tables, or 4 bf16 casts
    return out


def paper_activations(shape: ModelShape, tp: int, batch: int, seq: int,
                      sequence_parallel: bool = False, recompute: str = "none") -> int:
    """Korthikanti et al. 2022 (eq. 1-5), bytes per rank for all layers, 16-bit activations."""
    s, b, h, a, t = seq, batch, shape.dim, shape.n_head, tp
    scores = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        per_layer = 2 * s * b * h / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = s * b * h / t * (34 + scores)
    elif t > 1:
        per_layer = s * b * h * (10 + 24 / t + scores / t)
    else:
        per_layer = s * b * h * (34 + scores)
    return round(shape.n_layer * per_layer)


def moe_terms(step: Step, rank: int, N: int, Ns: int, act: int) -> dict:
    """An MoE layer's terms in place of the MLP's (an estimate from ``ParallelMoE``'s code, not
    yet measured): each TP rank routes n tokens (its ``tensor_split`` share of the N, or under
    SP its shard), so sends n·k rows and, routing even, receives as many; kept for backward are
    the router's fp32 logits and scores (n x E each), the rows sent, the rows received in
    expert order, SwiGLU's four (n·k, H_e) tensors, and the experts' outputs for the weighted
    sum (n·k x D each, in autocast's dtype); the shared experts keep what the MLP keeps, at
    their width. Under autocast the bf16 copies are of this EP rank's experts, the router and
    the shared experts' TP share (``experts.moe_tensors``)."""
    shape, tp, m = step.shape, step.tp, step.shape.moe
    n = Ns if step.sequence_parallel and tp > 1 else shard_sizes(N, tp)[rank]
    rows = n * m.top_k
    shared = shard_sizes(m.shared_hidden, tp)[rank] if m.shared_hidden else 0
    mlp_copies = (3 if shape.gated_mlp else 2) * shard_sizes(shape.hidden_dim, tp)[rank] * \
        shape.dim * 2
    copies = 0
    if step.autocast:
        moe = moe_tensors(shape, tp, rank, step.ep)
        copies = block_copies(shape, rank_shapes(shape, tp, rank)) - mlp_copies + \
            2 * sum(d * r for name, d, r in moe if not name.endswith("bias"))
    return {"mlp": 4 * rows * m.hidden * act + 4 * N * shared * act,
            "router": 2 * n * m.experts * 4, "expert rows": 3 * rows * shape.dim * act,
            "weight copies": copies}
