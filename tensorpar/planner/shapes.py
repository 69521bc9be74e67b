"""Model shapes for the planner: ``ModelShape``, presets by name, and Hugging Face configs.

A ``ModelShape`` describes a decoder-only transformer by its sizes only (nothing is built). It
comes from a preset (the published shapes of GPT-2 and Llama 2/3) or a Hugging Face
``config.json`` dict (Llama, Mistral, Qwen2 and GPT-2 keys, and the Mixture-of-Experts families:
Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek-V3; plain json, no transformers). MoE layers and
latent attention are ``experts.py``'s. The trainer describes tensorpar's own GPT
(``tensorpar/train/shape.py``): the planner knows no model class.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar.planner.experts import Experts, LatentAttention, experts_from_hf, mla_from_hf


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
