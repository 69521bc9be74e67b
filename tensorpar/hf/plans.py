"""Built-in plans for Hugging Face transformers models, and plans translated from their configs.

The built-in plans (how each family is split, whole)::

    GPT-2:                                      Llama, Mistral, Qwen2, Qwen3:
    transformer.wte        vocab                model.embed_tokens        vocab
    transformer.h.*.attn   attention            model.layers.*.self_attn  attention
    transformer.h.*.mlp    mlp                  model.layers.*.mlp        mlp
    lm_head                column_gather        lm_head                   column_gather

    Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GPT-OSS: the Llama plan with
    model.layers.*.mlp        moe   (hf/moe.py: experts cut across the EP ranks, shared
                                     experts as mlp, the router whole)

Position embeddings (GPT-2's ``wpe``), norms and Qwen3's per-head q/k norms stay replicated.
Another model that declares ``base_model_tp_plan`` in its config gets a plan translated from it.
``lm_head`` gathers its vocab-split logits, so the model's own loss and ``generate()`` run
unchanged (use ``vocab_parallel_cross_entropy`` on a ``column`` head to avoid the gather).

``check_split`` says, before anything is converted, whether a plan's style can split a module
over n ranks (GPT-NeoX's per-head fused q|k|v needs n to divide its heads).
"""

from __future__ import annotations

from torch import nn

from tensorpar.hf.moe import check_moe_block
from tensorpar.transformer.attention import head_shards

OUT_PROJ = ("o_proj", "out_proj", "dense")  # names of the attention output projection

GPT2_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn": "attention",
    "transformer.h.*.mlp": "mlp",
    "lm_head": "column_gather",
}
LLAMA_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn": "attention",
    "model.layers.*.mlp": "mlp",
    "lm_head": "column_gather",
}
MOE_PLAN = LLAMA_PLAN | {"model.layers.*.mlp": "moe"}
PLANS = {"gpt2": GPT2_PLAN, "llama": LLAMA_PLAN, "mistral": LLAMA_PLAN, "qwen2": LLAMA_PLAN,
         "qwen3": LLAMA_PLAN, "qwen3_moe": MOE_PLAN, "mixtral": MOE_PLAN, "olmoe": MOE_PLAN,
         "qwen2_moe": MOE_PLAN, "gpt_oss": MOE_PLAN}
# families whose layers no style splits yet: model_type -> what is missing
REFUSED = {"deepseek_v3": "its multi-head latent attention (q_a_proj, q_b_proj, "
                          "kv_a_proj_with_mqa, kv_b_proj: low-rank projections with norms "
                          "between them) has no tensorpar style yet; its MoE blocks would take "
                          "style 'moe'"}

MLP_NAMES = ("mlp", "feed_forward", "ffn")  # parents translated to style "mlp"
_HF_STYLES = {"colwise": "column", "rowwise": "row", "colwise_gather_output": "column_gather",
              "colwise_rep": "column_gather", "embedding_rowwise": "vocab"}


def translate_hf_plan(hf_plan: dict[str, str], prefix: str) -> dict[str, str]:
    """A transformers ``base_model_tp_plan`` as a tensorpar plan: q/k/v column + o row under one
    parent become ``attention``; column children + one row child become ``mlp``."""
    children: dict[str, dict[str, str]] = {}
    plan: dict[str, str] = {}
    for key, style in hf_plan.items():
        parent, _, child = key.rpartition(".")
        if style.startswith("replicated"):
            continue
        children.setdefault(parent, {})[child] = style
    for parent, kids in children.items():
        rows = [c for c, s in kids.items() if s == "rowwise"]
        full = f"{prefix}.{parent}" if prefix and parent else (parent or prefix)
        if {"q_proj", "k_proj", "v_proj"} <= kids.keys() and kids.keys() & set(OUT_PROJ):
            plan[full] = "attention"
        elif parent.rpartition(".")[2] in MLP_NAMES and len(rows) == 1 and len(kids) > 1 and \
                all(s == "colwise" for c, s in kids.items() if c not in rows):
            plan[full] = "mlp"
        else:
            for child, style in kids.items():
                if style not in _HF_STYLES:
                    raise ValueError(f"base_model_tp_plan style {style!r} for "
                                     f"{parent + '.' + child!r} has no tensorpar equivalent; pass "
                                     "plan= (see tensorpar.hf.parallelize)")
                plan[f"{full}.{child}"] = _HF_STYLES[style]
    return plan


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)


def plan_for(model: nn.Module) -> dict[str, str]:
    """The built-in plan for ``model``'s family, or one translated from its config's
    ``base_model_tp_plan``; otherwise a ValueError listing its linear layers."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type in REFUSED:
        raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: "
                         f"{REFUSED[model_type]}")
    if model_type in PLANS:
        return dict(PLANS[model_type])
    hf_plan = getattr(cfg, "base_model_tp_plan", None)
    if hf_plan:
        plan = translate_hf_plan(hf_plan, getattr(model, "base_model_prefix", ""))
        emb = _module_name(model, model.get_input_embeddings())
        if emb and emb not in plan:
            plan[emb] = "vocab"
        if isinstance(getattr(model, "lm_head", None), nn.Linear):
            plan["lm_head"] = "column_gather"
        return plan
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)]
    shown = "\n  ".join(linears[:12]) + ("\n  ..." if len(linears) > 12 else "")
    raise ValueError(
        f"no tensor-parallel plan for {type(model).__name__} (model_type={model_type!r}). Its "
        f"linear layers:\n  {shown}\nPass plan={{pattern: style}}, for example "
        "{'model.layers.*.self_attn': 'attention', 'model.layers.*.mlp': 'mlp', "
        "'model.embed_tokens': 'vocab', 'lm_head': 'column_gather'}; styles: vocab, column, "
        "column_gather, row, attention, mlp, replicated ('*' matches one name component).")


def tied_heads(model: nn.Module) -> dict[str, str]:
    """{'lm_head': embedding module name} when the head shares the input embedding's weight."""
    cfg = getattr(model, "config", None)
    head, emb = getattr(model, "lm_head", None), model.get_input_embeddings() \
        if hasattr(model, "get_input_embeddings") else None
    if head is None or emb is None:
        return {}
    if head.weight is emb.weight or getattr(cfg, "tie_word_embeddings", False):
        return {"lm_head": _module_name(model, emb)}
    return {}


def is_conv1d(m: nn.Module) -> bool:  # GPT-2's Conv1D: weight (in, out), y = x W + b
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


def attention_heads(m: nn.Module, cfg) -> tuple[int, int]:
    """(query heads, KV heads) of an attention module, from its config or its own attributes."""
    H = getattr(cfg, "num_attention_heads", None) or getattr(m, "num_heads", None)
    return H, getattr(cfg, "num_key_value_heads", None) or H


def check_split(model: nn.Module, name: str, style: str, n: int, ep: int | None = None) -> None:
    """Raise ValueError, naming ``name``, if ``style`` cannot split that module over ``n`` ranks
    (the converter calls it for each module; ``from_pretrained`` for the whole plan up front).

    It depends on the model and n only, so every rank raises the same error. ``attention``: every
    rank needs a query head (``head_shards``). ``column``/``row`` on a projection inside an
    attention module (a plan splitting q|k|v layer by layer, as GPT-NeoX's fused per-head
    ``query_key_value``): ``tensor_split`` of its features keeps every head whole and the q/kv
    ratio unchanged only when n divides both head counts; else the module's own forward would
    reshape cut heads. ``moe``: every one of the ``ep`` ranks (default n) needs an expert.
    """
    m = model.get_submodule(name)
    if style == "moe":
        check_moe_block(name, m, n if ep is None else ep)
        return
    if style == "attention":
        H, K = attention_heads(m, getattr(m, "config", None))
        try:
            if H is not None:  # no head count: the converter names what it lacks
                head_shards(H, K, n, 0)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        return
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    if style not in ("column", "column_gather", "row") or not any(
            isinstance(getattr(parent, a, None), int) for a in ("head_dim", "head_size")):
        return
    cfg = getattr(parent, "config", None) or getattr(model, "config", None)
    H, K = attention_heads(parent, cfg)
    if H and (H % n or K % n):
        kv = f" and {K} KV heads" if K != H else ""
        raise ValueError(f"{name}: style {style!r} splits this projection of the attention "
                         f"{parent_name} by features, which keeps heads whole only if the TP "
                         f"size divides the head counts: {H} heads{kv} over {n} ranks; use a TP "
                         f"size dividing {H}{f' and {K}' if kv else ''}")
