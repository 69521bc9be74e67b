"""What the trainer needs of a model (a *recipe*), and tensorpar's GPT as one.

The training loop (``loop.py``) and the run's start (``run.py``) know no model class: a recipe
builds one rank's model, says how its loss is computed, which tokenizer reads the text, what a
checkpoint's manifest records and how the planner sees the model. ``GPTRecipe`` is tensorpar's
GPT; ``hf_recipe.py`` has the recipe of a Hugging Face model (``tensorpar train --hf``).
A recipe travels to every rank (pickled), so it holds plain values only::

    kind                                  the manifest's model_kind ("gpt" records none)
    check(cfg)                            the launcher, before any rank: ValueError for a run the
                                          model cannot do (sizes that do not split over --tp)
    tokenizer()                           .encode(text) -> ids, .vocab_size, .name
    build(cfg, group, dp_rank, device)    -> (model, at_step): this rank's model, built on its TP
                                          group, and what to call before step s's forward (the
                                          dropout streams of step s)
    loss_fn(model, cfg, group)            -> loss(ids_BT, targets_BT, loss_tokens=None): the
                                          cross-entropy over the targets that are not ignored
                                          (-100), the same on every rank of the TP group (the
                                          logits split by vocabulary, never gathered): their mean,
                                          or with loss_tokens (a 0-dim tensor) their sum divided
                                          by it (a pass of an accumulated step)
    manifest()                            what a checkpoint records of the model ("config", ...)
    shape(), dropout                       the model as the planner sees it (the summary's plan)
    prepare(out)                          the lead rank, before the first step: files the run keeps
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tensorpar.checkpoint.format import model_kind
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.shape import gpt_shape
from tensorpar.gpt.tokenizer import ByteTokenizer
from tensorpar.parallel.dropout import TensorParallelRNG
from tensorpar.planner.shapes import ModelShape
from tensorpar.train.compute import loss_function


@dataclass
class GPTRecipe:
    """tensorpar's GPT (``model.py``) with the byte tokenizer."""

    model_cfg: GPTConfig
    kind = "gpt"

    @classmethod
    def from_flags(cls, model_args: dict, manifest: dict | None = None,
                   ckpt: Path | None = None) -> GPTRecipe:
        """The GPT of the model flags (None: not given), or of the checkpoint being resumed,
        whose model a given flag must not contradict."""
        if manifest is None:
            return cls(GPTConfig(**{k: v for k, v in model_args.items() if v is not None}))
        if model_kind(manifest) != cls.kind:
            raise ValueError(f"{ckpt} holds a model of kind {model_kind(manifest)!r}, not "
                             "tensorpar's GPT: resume it with tensorpar train --hf")
        saved = manifest["config"]
        for k, v in model_args.items():
            if k == "hidden_dim" and v == 0:  # 0 means "the default for dim"
                continue
            if v is not None and saved.get(k) != v:
                raise ValueError(f"--{k.replace('_', '-')} {v} disagrees with the checkpoint "
                                 f"{ckpt} ({k}={saved.get(k)})")
        return cls(GPTConfig(**saved))

    def check(self, cfg) -> None:
        self.model_cfg.check(cfg.tp)
        if self.model_cfg.vocab_size != ByteTokenizer.vocab_size:
            raise ValueError(f"--vocab-size {self.model_cfg.vocab_size}: the byte tokenizer "
                             f"needs {ByteTokenizer.vocab_size}")

    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def build(self, cfg, group, dp_rank: int,
              device: torch.device) -> tuple[nn.Module, Callable[[int], None]]:
        rng = TensorParallelRNG(cfg.seed, group, dp_rank)  # dropout masks differ by dp rank
        net = GPT(self.model_cfg, group, cfg.sequence_parallel, seed=cfg.seed, rng=rng,
                  device=device, fused=cfg.fused, recompute=cfg.recompute)
        return net, rng.set_step

    def loss_fn(self, model: nn.Module, cfg, group) -> Callable:
        return loss_function(model, cfg.compile, cfg.compile_backend)  # GPT(ids, targets)

    def manifest(self) -> dict:
        return {"config": dataclasses.asdict(self.model_cfg), "tokenizer": ByteTokenizer.name}

    def shape(self) -> ModelShape:
        return gpt_shape(self.model_cfg)

    @property
    def dropout(self) -> bool:
        return self.model_cfg.dropout > 0

    def prepare(self, out: Path) -> None:
        """Nothing: the manifest holds all the GPT needs."""
