"""The parts of a model's shape the dense planner does not know: Mixture-of-Experts layers
(``Experts``) and DeepSeek's multi-head latent attention (``LatentAttention``), their parameter
counts, and how Hugging Face configs name them.

An MoE layer replaces a block's MLP with a router (E x D, a bias in GPT-OSS), E routed SwiGLU
experts of width H_e (each 3·D·H_e, biases in GPT-OSS) of which each token uses k, and
optionally shared experts every token uses (a SwiGLU of width ``shared_hidden``, split over TP as
the MLP). Which layers are MoE: all but the first ``dense_first`` (DeepSeek's
``first_k_dense_replace``) and the indices in ``dense_layers`` (Qwen2/3-MoE's ``mlp_only_layers``
and every layer not on its ``decoder_sparse_step``); those keep the dense MLP of ``hidden_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar.parallel.sharding import shard_sizes

ROUTERS = ("softmax", "sigmoid")  # the library's MoEConfig.router


@dataclass(frozen=True)
class Experts:
    """The MoE layers of a model."""

    experts: int  # routed experts E
    top_k: int  # experts each token goes to
    hidden: int  # each routed expert's SwiGLU width H_e
    shared_hidden: int = 0  # the shared experts' width in all (count x each one's), 0: none
    shared: int = 0  # how many shared experts make that width (reported only)
    dense_first: int = 0  # the first layers keep a dense MLP
    dense_layers: tuple[int, ...] = ()  # other layers that keep a dense MLP
    router: str = "softmax"  # "softmax" (Mixtral, Qwen, GPT-OSS) or "sigmoid" (DeepSeek-V3)
    router_bias: bool = False  # the router's linear has a bias (GPT-OSS)
    selection_bias: bool = False  # a per-expert bias for selection only (DeepSeek-V3's)
    expert_bias: bool = False  # the experts' projections have biases (GPT-OSS)
    shared_gate: bool = False  # a sigmoid gate (D -> 1) on the shared experts (Qwen2-MoE)

    def __post_init__(self):
        if min(self.experts, self.top_k, self.hidden) < 1:
            raise ValueError(f"experts {self.experts}, top-k {self.top_k}, expert width "
                             f"{self.hidden}: each must be at least 1")
        if self.top_k > self.experts:
            raise ValueError(f"top-k {self.top_k} is more than the {self.experts} experts")
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r}: expected one of {', '.join(ROUTERS)}")

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_first and layer not in self.dense_layers

    def moe_layers(self, n_layer: int) -> int:
        return sum(self.is_moe(i) for i in range(n_layer))

    def expert_params(self, dim: int) -> int:
        """One routed expert's elements: gate, up (D -> H_e), down (H_e -> D), and biases."""
        return 3 * dim * self.hidden + (2 * self.hidden + dim if self.expert_bias else 0)

    def router_params(self, dim: int) -> int:
        return self.experts * (dim + self.router_bias + self.selection_bias)

    def shared_params(self, dim: int) -> int:
        return 3 * dim * self.shared_hidden + (dim if self.shared_gate else 0)


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek-V2/V3's multi-head latent attention: q through a rank-``q_lora`` bottleneck
    (0: a plain D x h·(nope + rope) projection), K and V from one rank-``kv_lora`` latent plus
    a shared rope key; each bottleneck normed (RMSNorm)."""

    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int

    def params(self, dim: int, heads: int) -> int:
        qk = self.qk_nope + self.qk_rope
        q = dim * heads * qk if not self.q_lora else \
            dim * self.q_lora + self.q_lora + self.q_lora * heads * qk
        kv = dim * (self.kv_lora + self.qk_rope) + self.kv_lora + \
            self.kv_lora * heads * (self.qk_nope + self.v_head)
        return q + kv + heads * self.v_head * dim

    def replicated(self, dim: int) -> int:
        """The elements every TP rank holds whole: the down projections into the bottlenecks
        and their norms (Megatron's split; the up projections and o_proj split by heads)."""
        return (dim * self.q_lora + self.q_lora if self.q_lora else 0) + \
            dim * (self.kv_lora + self.qk_rope) + self.kv_lora


def experts_from_hf(d: dict, n_layer: int) -> Experts | None:
    """The MoE layers a Hugging Face ``config.json`` dict describes (Mixtral, Qwen2/3-MoE,
    OLMoE, GPT-OSS, DeepSeek-V3 keys), or None for a dense model."""
    model_type = d.get("model_type", "")
    E = d.get("num_local_experts") or d.get("num_experts") or d.get("n_routed_experts")
    if not E:
        return None
    hidden = d.get("moe_intermediate_size") or d["intermediate_size"]
    shared_each = d.get("shared_expert_intermediate_size") or 0  # Qwen2-MoE: one, this wide
    shared = 1 if shared_each else int(d.get("n_shared_experts") or 0)
    if d.get("n_shared_experts"):  # DeepSeek: n shared experts of the routed width
        shared_each = hidden
    step = d.get("decoder_sparse_step") or 1
    dense = {i for i in range(n_layer) if (i + 1) % step}
    dense |= set(d.get("mlp_only_layers") or ())
    gpt_oss = model_type == "gpt_oss"
    return Experts(
        E, d.get("num_experts_per_tok") or d.get("experts_per_token") or d["top_k"], hidden,
        shared_hidden=shared * shared_each, shared=shared,
        dense_first=int(d.get("first_k_dense_replace") or 0),
        dense_layers=tuple(sorted(dense)),
        router="sigmoid" if d.get("scoring_func") == "sigmoid" else "softmax",
        router_bias=gpt_oss, selection_bias=d.get("topk_method") == "noaux_tc",
        expert_bias=gpt_oss, shared_gate=bool(d.get("shared_expert_intermediate_size")))


def mla_from_hf(d: dict) -> LatentAttention | None:
    """DeepSeek's latent attention from its config keys, or None."""
    if not d.get("kv_lora_rank"):
        return None
    return LatentAttention(int(d.get("q_lora_rank") or 0), d["kv_lora_rank"],
                           d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"])


def moe_tensors(shape, tp: int, rank: int = 0, ep: int = 1, ep_rank: int = 0) -> list[tuple]:
    """The parameter tensors of one MoE layer's MLP on TP rank ``rank``, EP rank ``ep_rank``
    (name, dim 0, elements per row), as ``ParallelMoE`` holds them: the router whole on every
    rank, the rank's ``tensor_split`` share of the routed experts (fused gate-up (E_r, 2H_e, D)
    and down (E_r, D, H_e), their biases), the shared experts split over TP as the MLP."""
    m, D = shape.moe, shape.dim
    E_r = shard_sizes(m.experts, ep)[ep_rank]
    out = [("mlp.router.weight", m.experts, D)]
    out += [("mlp.router.bias", m.experts, 1)] if m.router_bias else []
    out += [("mlp.experts.gate_up_proj", E_r, 2 * m.hidden * D),
            ("mlp.experts.down_proj", E_r, D * m.hidden)]
    if m.expert_bias:
        out += [("mlp.experts.gate_up_proj_bias", E_r, 2 * m.hidden),
                ("mlp.experts.down_proj_bias", E_r, D)]
    if m.shared_hidden:
        Hs = shard_sizes(m.shared_hidden, tp)[rank]
        out += [("mlp.shared.gate", Hs, D), ("mlp.shared.up", Hs, D),
                ("mlp.shared.down", D, Hs)]
        out += [("mlp.shared_gate", 1, D)] if m.shared_gate else []
    return out


def rank_attention(shape, heads_local: int) -> int:
    """Latent attention's elements on a TP rank holding ``heads_local`` query heads: the
    bottlenecks' down projections and norms whole, the rest split by heads."""
    a = shape.mla
    whole = a.replicated(shape.dim)
    return whole + (a.params(shape.dim, shape.n_head) - whole) * heads_local // shape.n_head


def with_experts(dense: dict, shape, s: dict, tp: int, rank: int, ep: int,
                 ep_rank: int) -> dict:
    """``memory.rank_params``' count ``dense`` of a Llama-like block (the rank's local sizes
    ``s``) made this model's: latent attention's elements instead of q, k, v, o
    (``rank_attention``), the output bias, q/k norms and sinks of Qwen3 and GPT-OSS, and each
    MoE layer's MLP instead of the dense one (``with_moe``)."""
    D, hd, L = shape.dim, shape.head_dim, shape.n_layer
    extra = (D if shape.o_bias else 0) + (2 * hd if shape.qk_norm else 0) + \
        (s["heads"] if shape.sinks else 0)
    attention = 0
    if shape.mla is not None:
        dense_qkvo = (2 * s["heads"] + 2 * s["kv_heads"]) * hd * D
        attention = rank_attention(shape, s["heads"]) - dense_qkvo
    out = dense | {"total": dense["total"] + L * (extra + attention),
                   "matmul": dense["matmul"] + L * attention,
                   "block": dense["block"] + extra + attention, "experts": 0}
    mlp = (3 if shape.gated_mlp else 2) * s["hidden"] * D
    return out if shape.moe is None else with_moe(out, shape, tp, rank, ep, ep_rank, mlp)


def with_moe(dense: dict, shape, tp: int, rank: int, ep: int, ep_rank: int, mlp: int) -> dict:
    """``rank_params``' count ``dense`` (every layer with a dense MLP of ``mlp`` elements on
    the rank) with each MoE layer's MLP instead (``moe_tensors``): "experts" the rank's share of
    the routed experts, "block" the largest block."""
    moe = moe_tensors(shape, tp, rank, ep, ep_rank)
    n_moe, elements = shape.moe.moe_layers(shape.n_layer), sum(d * r for _, d, r in moe)
    matmul = sum(d * r for name, d, r in moe if not name.endswith("bias"))
    return {"total": dense["total"] + n_moe * (elements - mlp),
            "matmul": dense["matmul"] + n_moe * (matmul - mlp),
            "largest": max([dense["largest"]] + [d * r for _, d, r in moe]),
            "tensors": dense["tensors"] + n_moe * (len(moe) - (3 if shape.gated_mlp else 2)),
            "block": max(dense["block"], dense["block"] - mlp + elements),
            "experts": n_moe * sum(d * r for name, d, r in moe if ".experts." in name)}
