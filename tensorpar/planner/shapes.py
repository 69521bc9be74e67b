"""Model shapes for the planner: ``ModelShape``, presets by name, and Hugging Face configs.

A ``ModelShape`` describes a decoder-only transformer by its sizes only (nothing is built). It
comes from a preset (the published shapes of GPT-2 and Llama 2/3) or a Hugging Face
``config.json`` dict (Llama, Mistral, Qwen2 and GPT-2 keys, and the Mixture-of-Experts families:
Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek-V3; plain json, no transformers). MoE layers and
latent attention are ``Experts`` and ``LatentAttention`` below. The trainer describes
tensorpar's own GPT (``tensorpar/train/shape.py``): the planner knows no model class.
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


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer."""

    name: str
    vocab_size: int
    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    hidden_dim: int
    gated_mlp: bool = True  # SwiGLU: gate and up (D -> H) then down; else up, GELU, down
    norm: str = "rms"  # "rms" (weight) or "layer" (weight and bias)
    bias: bool = False  # biases on every linear layer (GPT-2)
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2)
    tie_embeddings: bool = False
    learned_pos: int = 0  # positions of a learned position table (GPT-2: 1024); 0: rotary
    head_dim: int = 0  # 0: dim // n_head
    # under SP the embedding's output is all-reduced and split at the first layer, as in a
    # Hugging Face model converted by tensorpar (hf/sequence.py), not reduce-scattered (the GPT)
    sp_embedding_all_reduce: bool = False
    # recomputed, each layer runs to its end again, the MLP's exit (row all-reduce) included, as
    # a Hugging Face model's gradient checkpointing does; the GPT's stops at its last saved tensor
    # (the MLP's exit only with dropout: its mask, drawn after the exit, is saved last)
    recompute_block_exit: bool = False
    moe: Experts | None = None  # the MoE layers (their MLP replaced); None: dense
    mla: LatentAttention | None = None  # DeepSeek's latent attention instead of q, k, v
    qk_norm: bool = False  # an RMSNorm of head_dim on q and on k (Qwen3)
    o_bias: bool = False  # a bias on the output projection alone (GPT-OSS, with qkv_bias)
    sinks: bool = False  # a learned attention sink per head (GPT-OSS)

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // max(self.n_head, 1))
        if min(self.vocab_size, self.n_layer, self.dim, self.n_head, self.n_kv_head,
               self.hidden_dim) < 1:
            raise ValueError(f"model {self.name}: sizes must be positive ({self})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model {self.name}: n_head {self.n_head} is not a multiple of "
                             f"n_kv_head {self.n_kv_head}")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"model {self.name}: norm {self.norm!r} must be 'rms' or 'layer'")

    def attention_params(self) -> int:
        """One block's attention elements (its norm not included)."""
        D, hd = self.dim, self.head_dim
        q, kv = self.n_head * hd, self.n_kv_head * hd
        if self.mla is not None:
            attn = self.mla.params(D, self.n_head)
        else:
            attn = D * (q + 2 * kv) + q * D
        if self.bias:
            attn += q + 2 * kv + D
        elif self.qkv_bias:
            attn += q + 2 * kv + (D if self.o_bias else 0)
        return attn + (2 * hd if self.qk_norm else 0) + (self.n_head if self.sinks else 0)

    def dense_mlp_params(self) -> int:
        mlp = (3 if self.gated_mlp else 2) * self.dim * self.hidden_dim
        if self.bias:
            mlp += (2 if self.gated_mlp else 1) * self.hidden_dim + self.dim
        return mlp

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Layer ``layer``'s MLP elements: the dense MLP's, or an MoE layer's router, routed
        experts (``active``: only the top-k a token uses) and shared experts."""
        m = self.moe
        if m is None or not m.is_moe(layer):
            return self.dense_mlp_params()
        routed = (m.top_k if active else m.experts) * m.expert_params(self.dim)
        return m.router_params(self.dim) + routed + m.shared_params(self.dim)

    def expert_params(self) -> int:
        """The routed experts' elements in all layers (what expert parallelism divides)."""
        m = self.moe
        return 0 if m is None else \
            m.moe_layers(self.n_layer) * m.experts * m.expert_params(self.dim)

    def params(self, active: bool = False, embedding: bool = True) -> int:
        """Parameter count: all of them, or ``active`` (those one token's forward uses: the
        top-k routed experts of each MoE layer, every other weight); ``embedding`` False leaves
        the input embedding table out (the convention of GPT-OSS's and DeepSeek-V3's published
        active counts; Mixtral's and Qwen's keep it)."""
        D, L = self.dim, self.n_layer
        norm = D * (2 if self.norm == "layer" else 1)
        head = 0 if self.tie_embeddings else self.vocab_size * D
        embed = self.vocab_size * D if embedding else 0
        blocks = sum(self.mlp_params(i, active) for i in range(L)) + \
            L * (self.attention_params() + 2 * norm)
        return embed + self.learned_pos * D + blocks + norm + head


def _gpt2(name, n_layer, dim, n_head):
    return ModelShape(name, 50257, n_layer, dim, n_head, n_head, 4 * dim, gated_mlp=False,
                     norm="layer", bias=True, tie_embeddings=True, learned_pos=1024)


def _llama(name, vocab, n_layer, dim, n_head, n_kv_head, hidden):
    return ModelShape(name, vocab, n_layer, dim, n_head, n_kv_head, hidden)


# the published shapes (GPT-2: Radford et al. 2019 and its released config.json files; Llama 2:
# Touvron et al. 2023, Table 1 and the HF configs; Llama 3: Meta's config.json files)
PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    _gpt2("gpt2", 12, 768, 12),
    _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    _llama("llama-2-7b", 32000, 32, 4096, 32, 32, 11008),
    _llama("llama-2-13b", 32000, 40, 5120, 40, 40, 13824),
    _llama("llama-2-70b", 32000, 80, 8192, 64, 8, 28672),
    _llama("llama-3-8b", 128256, 32, 4096, 32, 8, 14336),
    _llama("llama-3-70b", 128256, 80, 8192, 64, 8, 28672),
)}


# the Mixture-of-Experts presets: the keys of each model's published config.json on the Hugging
# Face hub (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, openai/gpt-oss-120b,
# deepseek-ai/DeepSeek-V3), read by shape_from_hf_config as any such file is
MOE_CONFIGS: dict[str, dict] = {
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "tie_word_embeddings": False},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "attention_bias": False,
        "tie_word_embeddings": False},
    "gpt-oss-120b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
        "num_experts_per_tok": 4, "attention_bias": True, "tie_word_embeddings": False},
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "tie_word_embeddings": False},
}


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def shape_from_hf_config(d: dict, name: str) -> ModelShape:
    """A shape from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Gemma, GPT-2
    keys)."""
    model_type = d.get("model_type", "")
    try:
        if model_type == "gpt2" or "n_embd" in d:
            dim = d["n_embd"]
            return ModelShape(name, d["vocab_size"], d["n_layer"], dim, d["n_head"], d["n_head"],
                             d.get("n_inner") or 4 * dim, gated_mlp=False, norm="layer",
                             bias=True, tie_embeddings=d.get("tie_word_embeddings", True),
                             learned_pos=d.get("n_positions", 1024), recompute_block_exit=True)
        heads = d["num_attention_heads"]
        mla = mla_from_hf(d)
        return ModelShape(
            name, d["vocab_size"], d["num_hidden_layers"], d["hidden_size"], heads,
            # latent attention: as many K and V heads as queries, of the q/k head width
            heads if mla else d.get("num_key_value_heads") or heads, d["intermediate_size"],
            bias=bool(d.get("mlp_bias", False)) and bool(d.get("attention_bias", False)),
            qkv_bias=bool(d.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            # transformers' default differs by family: Gemma ties, Llama does not
            tie_embeddings=bool(d.get("tie_word_embeddings", model_type.startswith("gemma"))),
            head_dim=(mla.qk_nope + mla.qk_rope) if mla else d.get("head_dim") or 0,
            sp_embedding_all_reduce=True, recompute_block_exit=True,
            moe=experts_from_hf(d, d["num_hidden_layers"]), mla=mla,
            qk_norm=model_type.startswith("qwen3"),
            o_bias=model_type == "gpt_oss" and bool(d.get("attention_bias", False)),
            sinks=model_type == "gpt_oss")
    except KeyError as e:
        raise ValueError(f"{name}: not a GPTConfig, tensorpar manifest or Hugging Face config "
                         f"(missing key {e})") from None
    except TypeError as e:  # a value of the wrong type (a string for a size, a null)
        raise ValueError(f"{name}: a value has the wrong type ({e})") from None


PRESETS.update({name: shape_from_hf_config(d, name) for name, d in MOE_CONFIGS.items()})
