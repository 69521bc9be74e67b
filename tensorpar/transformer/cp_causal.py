"""Causal attention of a CP rank's chunks without a mask: two kernel calls a chunk, merged exactly.

A CP rank holds two chunks of the sequence, global positions [a, b) each (``parallel/context.py``).
Under the causal rule a chunk's queries read the keys [0, b): every key before the chunk, and the
chunk's own keys under the square causal triangle. So each chunk is two calls of torch's CPU
flash kernel, neither with a mask::

    part 1: q[a:b] against k[0:a], v[0:a]     nothing masked     -> o1, lse1  (none when a = 0)
    part 2: q[a:b] against k[a:b], v[a:b]     is_causal=True     -> o2, lse2  (a square block)

    lse = logaddexp(lse1, lse2)                       per query row and head, in fp32
    o   = o1 · exp(lse1 - lse) + o2 · exp(lse2 - lse)  the softmax over [0, b) that one call gives

The merge is exact up to rounding: each part's softmax is renormalized to the whole row's sum
(the log-sum-exp of all its scores). Backward runs the kernel's own backward on each part with
the *merged* output and log-sum-exp (its P = exp(s - lse) is then the whole row's probability
and its rowsum(dO · O) the whole row's), and adds the parts' key and value gradients where they
overlap, as ring and flash attention merge their blocks.

What this saves against the mask path: no (T_i, T) mask (SDPA keeps an additive copy of it in
the queries' dtype, per layer), and no K/V per query head: the kernel reads grouped KV heads
itself (GQA). Kept for backward: q, the whole sequence's K and V (in sequence order), the output
and the log-sum-exp, exactly what a causal SDPA call on the same tensors keeps.

Only on CPU (``cp_causal_supported``): the kernel is torch's CPU flash attention. Elsewhere the
layer takes the mask path (``context_parallel.cp_attention_mask``), as it does for packed rows.
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def cp_causal_supported(q: torch.Tensor) -> bool:
    """Whether the mask-free path runs for these queries (torch's CPU flash kernel, floats)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                  torch.float16)


def _stats_dtype(q: torch.Tensor) -> torch.dtype:
    """The kernel's log-sum-exp dtype, in which the parts are merged and gradients summed."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _merge(o1, lse1, o2, lse2):
    """Two parts' outputs (B, h, n, hd) and log-sum-exps (B, h, n) -> the whole row's (the
    weighted sum in the log-sum-exps' dtype, returned in o1's)."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp()[..., None], (lse2 - lse).exp()[..., None]
    return (o1.to(lse.dtype) * w1 + o2.to(lse.dtype) * w2).to(o1.dtype), lse


class _CausalChunks(torch.autograd.Function):
    """forward: per chunk, the flash kernel on the keys before it and on its own square causal
    block, merged by log-sum-exp; backward: the kernel's backward on each part with the merged
    output and log-sum-exp, key and value gradients summed."""

    @staticmethod
    def forward(ctx, q, k, v, chunks):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty(q.shape[:-1], dtype=_stats_dtype(q))  # the kernel's own
        for q0, q1, a, b in chunks:
            qc = q[:, :, q0:q1]
            o, m = _flash(qc, k[:, :, a:b], v[:, :, a:b], is_causal=True)
            if a > 0:
                o_before, m_before = _flash(qc, k[:, :, :a], v[:, :, :a])
                o, m = _merge(o_before, m_before, o, m)
            out[:, :, q0:q1], lse[:, :, q0:q1] = o, m
        ctx.chunks = chunks
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        acc = _stats_dtype(q)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for q0, q1, a, b in ctx.chunks:
            g, qc, o, m = grad[:, :, q0:q1], q[:, :, q0:q1], out[:, :, q0:q1], lse[:, :, q0:q1]
            dqc, dkc, dvc = _flash_backward(g, qc, k[:, :, a:b], v[:, :, a:b], o, m, 0.0, True)
            dk[:, :, a:b] += dkc
            dv[:, :, a:b] += dvc
            if a > 0:
                dq_before, dk_before, dv_before = _flash_backward(
                    g, qc, k[:, :, :a], v[:, :, :a], o, m, 0.0, False)
                dqc = (dqc.to(acc) + dq_before).to(q.dtype)
                dk[:, :, :a] += dk_before
                dv[:, :, :a] += dv_before
            dq[:, :, q0:q1] = dqc
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Causal attention of a CP rank's queries against the whole sequence's keys, no mask.

    q: (B, h, T_i, hd), the rank's tokens in the order it holds them (its chunks one after the
    other). k, v: (B, kv, T, hd), the whole sequence in sequence order; kv divides h, query head
    j reading KV head j // (h / kv) (the kernel groups them: K and V are not repeated).
    chunks: the global ranges [a, b) of the rank's chunks, in the order q holds them
    (``parallel.context.cp_chunk_ranges``). Returns (B, h, T_i, hd) in q's dtype.
    """
    spans, q0 = [], 0
    for a, b in chunks:
        spans.append((q0, q0 + b - a, a, b))
        q0 += b - a
    if q0 != q.shape[2]:
        raise ValueError(f"cp_causal_attention: the chunks hold {q0} queries, q has {q.shape[2]}")
    return _CausalChunks.apply(q, k, v, spans)
