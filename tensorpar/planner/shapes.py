"""Model shapes for the planner: ``ModelShape``, presets by name, and Hugging Face configs.

A ``ModelShape`` describes a decoder-only transformer by its sizes only (nothing is built). It
comes from a preset (the published shapes of GPT-2 and Llama 2/3) or a Hugging Face
``config.json`` dict (Llama, Mistral, Qwen2 and GPT-2 keys; plain json, no transformers).
the trainer describes tensorpar's own GPT (``tensorpar/train/shape.py``): the planner knows no
model class.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def params(self) -> int:
        """Dense parameter count."""
        D, hd, L = self.dim, self.head_dim, self.n_layer
        q, kv = self.n_head * hd, self.n_kv_head * hd
        attn = D * (q + 2 * kv) + q * D
        mlp = (3 if self.gated_mlp else 2) * D * self.hidden_dim
        norm = D * (2 if self.norm == "layer" else 1)
        if self.bias:
            attn += q + 2 * kv + D
            mlp += (2 if self.gated_mlp else 1) * self.hidden_dim + D
        elif self.qkv_bias:
            attn += q + 2 * kv
        head = 0 if self.tie_embeddings else self.vocab_size * D
        return (self.vocab_size * D + self.learned_pos * D + L * (attn + mlp + 2 * norm)
                + norm + head)


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
        return ModelShape(
            name, d["vocab_size"], d["num_hidden_layers"], d["hidden_size"], heads,
            d.get("num_key_value_heads") or heads, d["intermediate_size"],
            bias=bool(d.get("mlp_bias", False)) and bool(d.get("attention_bias", False)),
            qkv_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            # transformers' default differs by family: Gemma ties, Llama does not
            tie_embeddings=bool(d.get("tie_word_embeddings", model_type.startswith("gemma"))),
            head_dim=d.get("head_dim") or 0, sp_embedding_all_reduce=True,
            recompute_block_exit=True)
    except KeyError as e:
        raise ValueError(f"{name}: not a GPTConfig, tensorpar manifest or Hugging Face config "
                         f"(missing key {e})") from None
    except TypeError as e:  # a value of the wrong type (a string for a size, a null)
        raise ValueError(f"{name}: a value has the wrong type ({e})") from None
