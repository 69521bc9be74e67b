"""Dense single-device reference modules in plain PyTorch, for ``tensorpar verify`` and the tests.

Nothing here knows about tensor parallelism: these are what the parallel layers must reproduce.
Module and attribute names match the parallel versions (``attn.q_proj``, ``mlp.gate``...) so a
parameter's dense counterpart is found by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.transformer.rotary import apply_rotary


class DenseAttention(nn.Module):
    """Causal multi-head attention with grouped-query support (KV heads repeated per group) and
    optional rotary positions.

    Heads come from the projections' widths (``view(B, T, -1, head_dim)``), so under DTensor's
    colwise shards each rank sees only its own heads and the code does not change (the
    benchmark's DTensor contender relies on it).
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int | None = None,
                 bias: bool = False, causal: bool = True):
        super().__init__()
        hd = head_dim or dim // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim, self.causal = (
            num_heads, num_kv_heads, hd, causal)
        self.q_proj = nn.Linear(dim, num_heads * hd, bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * hd, bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * hd, bias)
        self.o_proj = nn.Linear(num_heads * hd, dim, bias)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: (B, T, dim). rope: rotary (cos, sin) tables for the T positions, or None."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        group_size = q.shape[1] // k.shape[1]  # query head j reads KV head j // group_size
        k = k.repeat_interleave(group_size, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(group_size, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DenseMLP(nn.Module):
    """down(act(up(x))), or down(act(gate(x)) * up(x)) when gated (SwiGLU with silu)."""

    def __init__(self, dim: int, hidden_dim: int, gated: bool = True, bias: bool = False,
                 activation=F.silu):
        super().__init__()
        self.gate = nn.Linear(dim, hidden_dim, bias) if gated else None
        self.up = nn.Linear(dim, hidden_dim, bias)
        self.down = nn.Linear(hidden_dim, dim, bias)
        self.act = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = self.act(h) if self.gate is None else self.act(self.gate(x)) * h
        return self.down(h)


def _doc(default: int, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class BlockConfig:
    """Sizes of the verification model: embedding, one transformer block, LM head."""

    vocab_size: int = _doc(250, "vocabulary size (uneven shards over 3 and 4 ranks)")
    dim: int = _doc(64, "model width")
    num_heads: int = _doc(8, "query heads")
    num_kv_heads: int = _doc(2, "key/value heads (GQA; fewer than --tp shares them)")
    hidden_dim: int = _doc(172, "MLP hidden width")
    seq_len: int = _doc(12, "tokens per sequence (under SP at least --tp: shards may be uneven)")
    batch_size: int = _doc(2, "sequences per batch")


class DenseBlock(nn.Module):
    """Token embedding, one pre-norm transformer block (GQA + SwiGLU), final norm and LM head."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.attn = DenseAttention(cfg.dim, cfg.num_heads, cfg.num_kv_heads)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = DenseMLP(cfg.dim, cfg.hidden_dim, gated=True)
        self.norm_f = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(self.norm_f(h))  # (B, T, V)


class DenseMoE(nn.Module):
    """A Mixture of Experts written plainly, one token and one chosen expert at a time: the
    reference ``ParallelMoE`` is checked against (same parameter names and layouts).

    Returns the output and (balance loss, z-loss, tokens per expert) over all the tokens."""

    def __init__(self, config):  # a transformer.moe.MoEConfig
        super().__init__()
        c = self.config = config
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.randn(c.num_experts, c.dim) * c.dim ** -0.5)
        self.router.register_buffer("selection_bias", torch.zeros(c.num_experts))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(
            torch.randn(c.num_experts, 2 * c.hidden_dim, c.dim) * c.dim ** -0.5)
        self.experts.down_proj = nn.Parameter(
            torch.randn(c.num_experts, c.dim, c.hidden_dim) * c.hidden_dim ** -0.5)
        self.shared = (DenseMLP(c.dim, c.shared_hidden_dim, gated=True)
                       if c.shared_hidden_dim else None)

    def _route(self, x_t: torch.Tensor):
        """One token (D,) -> (its scores for the balancing loss, chosen experts, weights)."""
        c = self.config
        logits = self.router.weight @ x_t
        if c.router == "softmax":
            probs = torch.softmax(logits, 0)
            weights, chosen = torch.topk(probs, c.top_k)
        else:
            probs = torch.sigmoid(logits)
            chosen = torch.topk(probs.detach() + self.router.selection_bias, c.top_k)[1]
            weights = probs[chosen]
            probs = probs / probs.sum()
        if c.norm_topk_prob:
            weights = weights / weights.sum()
        return logits, probs, chosen, weights * c.route_scale

    def forward(self, x: torch.Tensor):
        c = self.config
        outs, load, prob_sum, lse2 = [], torch.zeros(c.num_experts), 0.0, 0.0
        for x_t in x.reshape(-1, c.dim):
            logits, probs, chosen, weights = self._route(x_t)
            y_t = torch.zeros_like(x_t)
            for e, w in zip(chosen.tolist(), weights, strict=True):
                gate, up = (self.experts.gate_up_proj[e] @ x_t).chunk(2)
                y_t = y_t + w * (self.experts.down_proj[e] @ (F.silu(gate) * up))
                load[e] += 1
            outs.append(y_t)
            prob_sum = prob_sum + probs
            lse2 = lse2 + torch.logsumexp(logits, 0) ** 2
        n = len(outs)
        y = torch.stack(outs).view_as(x)
        if self.shared is not None:
            y = y + self.shared(x)
        balance = c.num_experts * torch.sum(load / n * prob_sum / n)
        return y, (balance, lse2 / n, load)
