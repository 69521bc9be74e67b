"""tensorpar's GPT described to the planner, and the planner's model files read.

The planner (``tensorpar/planner/``) reasons about a ``ModelShape`` and knows no model class,
and the GPT knows no planner: the trainer, which imports both, describes the GPT here (its
recipe's ``shape()``).
``load_shape`` reads the JSON files ``tensorpar plan --config`` takes: a ``GPTConfig``, a
checkpoint's ``manifest.json`` (its "config"), or a Hugging Face ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tensorpar.gpt.model import GPTConfig
from tensorpar.planner.shapes import Experts, ModelShape, shape_from_hf_config


def gpt_shape(cfg: GPTConfig, name: str = "tensorpar-gpt") -> ModelShape:
    """The shape of ``GPT(cfg)``: RMSNorm, rotary, SwiGLU, no biases. With dropout a block's
    last saved tensor is the MLP branch's mask, drawn after the MLP's exit: a recomputed block
    runs that exit again (eagerly: under torch.compile the partitioner picks what it
    recomputes)."""
    moe = None if not cfg.moe_experts else Experts(
        cfg.moe_experts, cfg.moe_top_k, cfg.hidden_dim, cfg.moe_shared_experts * cfg.hidden_dim,
        cfg.moe_shared_experts, router=cfg.moe_router, selection_bias=cfg.moe_router == "sigmoid")
    return ModelShape(name, cfg.vocab_size, cfg.n_layer, cfg.dim, cfg.n_head, cfg.n_kv_head,
                     cfg.hidden_dim, tie_embeddings=cfg.tie_embeddings,
                     recompute_block_exit=cfg.dropout > 0, moe=moe)


def shape_from_dict(d: dict, name: str) -> ModelShape:
    """A shape from a GPTConfig dict, a checkpoint manifest or a Hugging Face config dict."""
    if "config" in d and isinstance(d["config"], dict):  # a tensorpar manifest.json
        d = d["config"]
    if "n_layer" in d and "dim" in d:  # a tensorpar GPTConfig
        known = {f.name for f in dataclasses.fields(GPTConfig)}
        try:
            return gpt_shape(GPTConfig(**{k: v for k, v in d.items() if k in known}), name)
        except TypeError as e:  # a value of the wrong type (a string for a size, a null)
            raise ValueError(f"{name}: a value has the wrong type ({e})") from None
    return shape_from_hf_config(d, name)


def load_shape(path: str | Path) -> ModelShape:
    """A shape from a JSON file (see ``shape_from_dict``); a directory means its manifest.json or
    config.json."""
    path = Path(path)
    if path.is_dir():
        path = path / ("manifest.json" if (path / "manifest.json").exists() else "config.json")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"--config {path}: expected a JSON object")
    return shape_from_dict(d, path.parent.name if path.name in ("config.json", "manifest.json")
                          else path.stem)
