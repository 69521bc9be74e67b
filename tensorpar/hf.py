"""Hugging Face transformers models: built-in plans, ``parallelize`` and ``from_pretrained``.

Needs the ``hf`` extra (``pip install tensorpar[hf]``); the rest of tensorpar never imports it.

The built-in plans (the whole layout of each family)::

    GPT-2:                                      Llama, Mistral, Qwen2, Qwen3:
    transformer.wte        vocab                model.embed_tokens        vocab
    transformer.h.*.attn   attention            model.layers.*.self_attn  attention
    transformer.h.*.mlp    mlp                  model.layers.*.mlp        mlp
    lm_head                column_gather        lm_head                   column_gather

Position embeddings (GPT-2's ``wpe``), norms and Qwen3's per-head q/k norms stay replicated.
Another model that declares ``base_model_tp_plan`` in its config gets a plan translated from it.
``lm_head`` gathers its vocab-split logits, so the model's own loss and ``generate()`` run
unchanged (use ``vocab_parallel_cross_entropy`` on a ``column`` head to avoid the gather).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.distributed import tp_size
from tensorpar.parallelize import apply_plan
from tensorpar.styles import OUT_PROJ, is_conv1d

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
PLANS = {"gpt2": GPT2_PLAN, "llama": LLAMA_PLAN, "mistral": LLAMA_PLAN, "qwen2": LLAMA_PLAN,
         "qwen3": LLAMA_PLAN}

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
                                     "plan= (see tensorpar.parallelize)")
                plan[f"{full}.{child}"] = _HF_STYLES[style]
    return plan


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)


def plan_for(model: nn.Module) -> dict[str, str]:
    """The built-in plan for ``model``'s family, or one translated from its config's
    ``base_model_tp_plan``; otherwise a ValueError listing its linear layers."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
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


def _tied(model: nn.Module) -> dict[str, str]:
    """{'lm_head': embedding module name} when the head shares the input embedding's weight."""
    cfg = getattr(model, "config", None)
    head, emb = getattr(model, "lm_head", None), model.get_input_embeddings() \
        if hasattr(model, "get_input_embeddings") else None
    if head is None or emb is None:
        return {}
    if head.weight is emb.weight or getattr(cfg, "tie_word_embeddings", False):
        return {"lm_head": _module_name(model, emb)}
    return {}


def check_same_weights(model: nn.Module, group: ProcessGroup | None = None) -> None:
    """Raise ValueError on every rank unless all ranks hold the same dense weights (one small
    all-gather of per-parameter checksums)."""
    if tp_size(group) == 1:
        return
    names = [n for n, p in model.named_parameters() if not p.is_meta]
    sums = torch.stack([p.detach().double().sum() for n, p in model.named_parameters()
                        if not p.is_meta]).cpu()
    every = [torch.empty_like(sums) for _ in range(tp_size(group))]
    dist.all_gather(every, sums, group=group)
    differ = [names[i] for i in range(len(names))
              if any(not torch.equal(e[i], every[0][i]) for e in every)]
    if differ:
        raise ValueError(f"the ranks hold different dense weights ({', '.join(differ[:3])}"
                         f"{', ...' if len(differ) > 3 else ''}): build the model from the same "
                         "seed or checkpoint on every rank before parallelize()")


def parallelize(model: nn.Module, plan: dict[str, str] | None = None,
                group: ProcessGroup | None = None) -> nn.Module:
    """Convert a dense model in place to tensor parallelism over ``group`` and return it.

    Every rank must hold the same dense model (same seed or the same checkpoint); this is
    checked. ``plan`` defaults to the built-in plan of the model's family (module docstring).
    """
    plan = plan or plan_for(model)
    check_same_weights(model, group)
    return apply_plan(model, plan, group, tied=_tied(model))


class SafetensorsSource:
    """Slices of the tensors of a Hugging Face model directory, read without loading the rest."""

    def __init__(self, path: str | Path, prefix: str = "",
                 renames: list[tuple[str, str]] = ()):
        from safetensors import safe_open

        self.path, self.prefix, self._safe_open = Path(path), prefix, safe_open
        self._files: dict[str, object] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            keys = self._open("model.safetensors").keys()
            self.weight_map = dict.fromkeys(keys, "model.safetensors")
        else:
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
        # model parameter name -> key in the files (older checkpoints use older names)
        self.file_key = {}
        for key in self.weight_map:
            name = key
            for pattern, repl in renames:
                name = re.sub(pattern, repl, name)
            self.file_key[name] = key

    def _open(self, fname: str):
        if fname not in self._files:
            self._files[fname] = self._safe_open(self.path / fname, framework="pt")
        return self._files[fname]

    def _key(self, name: str) -> str:
        bare = name.removeprefix(f"{self.prefix}.")  # older files omit the base model's prefix
        for candidate in (name, bare):
            if candidate in self.file_key:
                return self.file_key[candidate]
        raise ValueError(f"{self.path}: no tensor for {name!r} in the checkpoint")

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        key = self._key(key)
        piece = self._open(self.weight_map[key]).get_slice(key)
        if dim is not None:
            stop = piece.get_shape()[dim] if stop is None else stop
        t = piece[:] if dim is None else piece[(slice(None),) * dim + (slice(start, stop),)]
        # an owned, compact copy: the result may view the memory-mapped file or whole rows of it
        return t.clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        self._files.clear()  # unmaps the files


def _renames(model: nn.Module) -> list[tuple[str, str]]:
    """The plain key renamings transformers applies when loading this model's checkpoints
    (e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``). Other conversions (packed experts) are not
    supported: their tensors are then reported missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        rules = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):  # older transformers: no renamings
        return []
    return [(r.source_patterns[0], r.target_patterns[0]) for r in rules
            if type(r) is WeightRenaming and len(r.source_patterns) == 1]


def from_pretrained(path: str | Path, group: ProcessGroup | None = None,
                    dtype: torch.dtype = torch.float32, plan: dict[str, str] | None = None,
                    attn_implementation: str | None = None) -> nn.Module:
    """Load a local Hugging Face causal-LM directory (config + safetensors) tensor-parallel.

    The model is built with its parameters on the meta device; each rank then reads only its own
    slices of the split weights (and the replicated ones whole), so per-rank memory is about 1/N
    of the split weights plus the replicated ones.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    source = SafetensorsSource(path, model.base_model_prefix, _renames(model))
    apply_plan(model, plan or plan_for(model), group, source=source, dtype=dtype,
               tied=_tied(model))
    source.close()
    if (Path(path) / "generation_config.json").is_file():  # eos lists, sampling defaults, ...
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
