"""What the trainer needs of a model (a *recipe*), and tensorpar's GPT as one.

The training loop (``loop.py``) and the run's start (``run.py``) know no model class: a recipe
builds one rank's model, says how its loss is computed, which tokenizer reads the text, what a
checkpoint's manifest records and how the planner sees the model. ``GPTRecipe`` is tensorpar's
GPT; ``hf_recipe.py`` has the recipe of a Hugging Face model (``tensorpar train --hf``). Each
kind also has the function that resolves its run from the command line (``resolve_gpt``,
``resolve_hf``: ``run.RECIPES``, by kind). A recipe travels to every rank (pickled), so it
holds plain values only::

    kind                                  the manifest's model_kind ("gpt" records none)
    check(cfg)                            the launcher, before any rank: ValueError for a run the
                                          model cannot do (sizes that do not split over --tp)
    tokenizer()                           .encode(text) -> ids, .vocab_size, .name
    build(cfg, group, dp_rank, device)    -> (model, at_step): this rank's model, built on its TP
                                          group, and what to call before step s's forward (the
                                          dropout streams of step s); under --cp also given
                                          cp_group= (a recipe with context_parallel = True)
    loss_fn(model, cfg, group)            -> loss(ids_BT, targets_BT, loss_tokens=None): the
                                          cross-entropy over the targets that are not ignored
                                          (-100), the same on every rank of the TP group (the
                                          logits split by vocabulary, never gathered): their mean,
                                          or with loss_tokens (a 0-dim tensor) their sum divided
                                          by it (a pass of an accumulated step)
    manifest()                            what a checkpoint records of the model ("config", ...)
    shape(), dropout                       the model as the planner sees it (the summary's plan)
    write_run_files(out)                  the lead rank, before the first step: the files the run
                                          keeps beside its checkpoints (a tokenizer, a model's
                                          config)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.checkpoint.format import model_kind
from tensorpar.data.chat import is_chat_file
from tensorpar.data.shards import TOKENIZER_DIR, is_shard_folder
from tensorpar.data.tokenizer import (
    RUN_TOKENIZER,
    ByteTokenizer,
    HFTokenizer,
    describe,
    run_tokenizer_dir,
    same_tokenizer,
)
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.dropout import TensorParallelRNG
from tensorpar.parallel.sharding import check_expert_parallel
from tensorpar.parallel.stages import check_pipeline
from tensorpar.planner.shapes import ModelShape
from tensorpar.train.compute import loss_function
from tensorpar.train.config import TrainConfig, passes
from tensorpar.train.resume import RunFlags, resolve_run
from tensorpar.train.shape import gpt_shape


@dataclass
class GPTRecipe:
    """tensorpar's GPT (``model.py``) with the byte tokenizer, or with the Hugging Face tokenizer
    folder ``tokenizer_dir`` (``--tokenizer DIR``; a run keeps a copy in ``RUN/tokenizer``)."""

    model_cfg: GPTConfig
    tokenizer_dir: str | None = None
    kind = "gpt"
    context_parallel = True  # build takes cp_group= (--cp)

    @classmethod
    def from_flags(cls, model_args: dict, tokenizer: str | None = None, data: str | None = None,
                   manifest: dict | None = None, ckpt: Path | None = None) -> GPTRecipe:
        """The GPT of the model flags (None: not given) and ``--tokenizer`` (default: that of the
        shard folder ``--data`` names, else bytes), or of the checkpoint being resumed, whose
        model and tokenizer a given flag must not contradict."""
        if manifest is None:
            if tokenizer is None and data is not None and is_shard_folder(data):
                tokenizer = str(Path(data) / TOKENIZER_DIR)  # the vocabulary follows the data
            args = {k: v for k, v in model_args.items() if v is not None}
            if tokenizer is not None:
                args.setdefault("vocab_size", HFTokenizer(tokenizer).vocab_size)
            return cls(GPTConfig(**args), tokenizer)
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
        recipe = cls(GPTConfig(**saved), run_tokenizer_dir(manifest, ckpt))
        if tokenizer is not None and not same_tokenizer(HFTokenizer(tokenizer),
                                                        recipe.tokenizer()):
            raise ValueError(f"--tokenizer {tokenizer} is not the tokenizer of the run being "
                             f"resumed ({describe(recipe.tokenizer())}): leave it out")
        return recipe

    def check(self, cfg) -> None:
        self.model_cfg.check(cfg.tp)
        check_experts(self.model_cfg, getattr(cfg, "ep", 1), cfg.tp, getattr(cfg, "dp", None))
        pp, virtual = getattr(cfg, "pp", 1), getattr(cfg, "pp_virtual", 1)
        if pp > 1 or virtual > 1:
            check_pipeline(pp, virtual, self.model_cfg.n_layer, passes(cfg))
        if is_chat_file(getattr(cfg, "data", None)) and self.tokenizer_dir is None:
            raise ValueError(f"--data {cfg.data}: chat or instruction examples need a tokenizer "
                             "with an end-of-text token (and a chat template for messages): "
                             "add --tokenizer DIR")
        if getattr(cfg, "lora_rank", None) is not None or getattr(cfg, "lora_init", None):
            raise ValueError("--lora-rank and --lora-init fine-tune a Hugging Face model (--hf "
                             "PATH); the GPT trains every weight")
        tok = ByteTokenizer() if self.tokenizer_dir is None else HFTokenizer(self.tokenizer_dir)
        if self.model_cfg.vocab_size < tok.vocab_size or (
                tok.name == ByteTokenizer.name and self.model_cfg.vocab_size != tok.vocab_size):
            raise ValueError(f"--vocab-size {self.model_cfg.vocab_size}: the tokenizer, "
                             f"{describe(tok)}, needs {tok.vocab_size}"
                             + ("" if tok.name == ByteTokenizer.name else " or more"))

    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        if self.tokenizer_dir is None:
            return ByteTokenizer()
        return HFTokenizer(self.tokenizer_dir, self.model_cfg.vocab_size)

    def build(self, cfg, group, dp_rank: int, device: torch.device, cp_group=None,
              **part) -> tuple[nn.Module, Callable[[int], None]]:
        """The model on this rank (``part``: a pipeline rank's blocks, embed and head, and the
        MoE blocks' ``experts`` groups, as ``GPT`` takes them; ``cp_group``: its context-parallel
        group, None without CP) and what sets each step's dropout streams."""
        cp_rank = None if cp_group is None else dist.get_rank(cp_group)
        # dropout masks differ by dp rank, and by CP rank (other tokens of the same rows)
        rng = TensorParallelRNG(cfg.seed, group, dp_rank, cp_rank)
        net = GPT(self.model_cfg, group, cfg.sequence_parallel, seed=cfg.seed, rng=rng,
                  device=device, fused=cfg.fused, recompute=cfg.recompute, cp_group=cp_group,
                  **part)
        return net, rng.set_step

    def loss_fn(self, model: nn.Module, cfg, group, experts=None) -> Callable:
        """experts: unused (the MoE blocks hold their groups and weigh their aux losses)."""
        return loss_function(model, cfg.compile, cfg.compile_backend)  # GPT(ids, targets)

    def expert_groups(self, cfg, mesh, run_group):
        """None: the GPT's MoE blocks get theirs from ``train/moe.py``."""
        return None

    def manifest(self) -> dict:
        tokenizer = {"tokenizer": ByteTokenizer.name} if self.tokenizer_dir is None else \
            {"tokenizer": HFTokenizer.name, "tokenizer_files": RUN_TOKENIZER}
        return {"config": dataclasses.asdict(self.model_cfg)} | tokenizer

    def shape(self) -> ModelShape:
        return gpt_shape(self.model_cfg)

    @property
    def dropout(self) -> bool:
        return self.model_cfg.dropout > 0

    def write_run_files(self, out: Path) -> None:
        """A copy of the tokenizer folder in ``out/tokenizer`` (atomically; a resumed run has it
        there already); nothing for bytes."""
        if self.tokenizer_dir is None:
            return
        target, tmp = out / RUN_TOKENIZER, out / f".{RUN_TOKENIZER}.tmp"
        if Path(self.tokenizer_dir).resolve() == target.resolve():
            return
        shutil.rmtree(tmp, ignore_errors=True)
        HFTokenizer(self.tokenizer_dir).save(tmp)
        shutil.rmtree(target, ignore_errors=True)  # an earlier start that saved no checkpoint
        os.rename(tmp, target)


def check_experts(model_cfg: GPTConfig, ep: int, tp: int, dp: int | None) -> None:
    """``--ep`` against the model's experts (``check_expert_parallel``, the one rule), the
    dense GPT's case told with its flag: one line naming the numbers."""
    if ep > 1 and not model_cfg.moe_experts:
        raise ValueError(f"--ep {ep} splits a Mixture of Experts' experts: add --moe-experts E "
                         "(the GPT is dense without it)")
    check_expert_parallel(ep, tp, dp, model_cfg.moe_experts)


def resolve_gpt(flags: RunFlags) -> tuple[TrainConfig, GPTRecipe, str | None]:
    """``tensorpar train`` of the GPT (or ``--resume`` of a GPT run): the flags merged with the
    run resumed (``resume.py``), the recipe from the model flags and ``--tokenizer``."""
    return resolve_run(flags.train, partial(GPTRecipe.from_flags, flags.model, flags.tokenizer,
                                            flags.train.get("data")))
