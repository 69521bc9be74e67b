"""A run's settings from the command line: the flags merged with the run being resumed and
checked before any rank starts (:func:`resolve_run`, for any model's recipe), below the recipes
(``gpt_recipe.py``, ``hf_recipe.py``) that each resolve their kind of run through it.

Resuming keeps the run's settings, its learning-rate schedule included (``--lr-decay-steps``,
stored in the manifest), so ``--steps 400`` then ``--resume --steps 800`` repeats one run of
``--steps 800 --lr-decay-steps 400`` step for step. Which checkpoint: the newest complete one in
``--out`` (:func:`resumed_checkpoint`); a new run refuses an ``--out`` that holds another.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.data.chat import is_chat_file
from tensorpar.data.text import check_corpus, overlap_warning
from tensorpar.runtime.groups import pick_backend, rank_device_type, wanted_device
from tensorpar.runtime.torchrun import say as speak
from tensorpar.runtime.torchrun import under_torchrun
from tensorpar.train.compute import check_compile_device, tf32_note
from tensorpar.train.config import TrainConfig, passes, pipeline_micro_batch
from tensorpar.train.history import resume_notes, saved_settings


@dataclass(frozen=True)
class RunFlags:
    """What ``tensorpar train`` was given, each flag None where it was not."""

    train: dict  # TrainConfig's fields
    model: dict  # the GPT's model flags (GPTConfig's fields)
    hf: str | None = None  # --hf PATH: a Hugging Face model to fine-tune
    tokenizer: str | None = None  # --tokenizer DIR: the GPT's tokenizer folder


# settings whose change makes a resumed run something else than the original's continuation
_SAME_RUN = ("seed", "batch_size", "seq_len", "data", "lr", "dtype", "warmup_steps",
             "lr_decay_steps", "tf32")


def resolve_run(train_args: dict, recipe_for: Callable) -> tuple[TrainConfig, object, str | None]:
    """Merge explicit flags with the checkpoint being resumed and the defaults; validate.
    Returns the training config, the model's recipe (``gpt_recipe.py``, ``hf_recipe.py``)
    and the checkpoint to resume.

    recipe_for(manifest, ckpt): the recipe of the run, from its flags (manifest None: a new run)
    or from the checkpoint being resumed. On resume, training settings default to the
    checkpoint's, so the resumed run repeats the original. Explicit flags still win for the
    settings that may change (steps, tp, ...).
    """
    explicit = {k: v for k, v in train_args.items() if v is not None}
    ckpt = resumed_checkpoint(explicit.get("out", TrainConfig.out), explicit.get("resume"))
    manifest = None if ckpt is None else CheckpointReader(ckpt).manifest
    saved = {} if manifest is None else saved_settings(manifest)
    for line in [] if manifest is None else resume_notes(manifest, ckpt):
        say(f"note: {line}")
    recipe = recipe_for(manifest, ckpt)
    changed = [k for k in _SAME_RUN if k in explicit and k in saved and explicit[k] != saved[k]]
    if changed:
        say(f"note: {', '.join('--' + k.replace('_', '-') for k in changed)} "
            "differ from the checkpoint's; the resumed run is not an exact continuation")
    cfg = TrainConfig(**(saved | explicit))
    cfg.dp = _dp_size(cfg, explicit.get("dp"))
    if cfg.lr_decay_steps is None:  # a new run: decay over its --steps, stored in its manifest
        cfg.lr_decay_steps = cfg.steps
    elif ("steps" in explicit and explicit["steps"] != saved.get("steps")
          and "lr_decay_steps" not in explicit):
        say(f"note: keeping the run's learning-rate schedule (cosine decay to "
            f"lr/10 at step {cfg.lr_decay_steps}, constant after); pass --lr-decay-steps to "
            "change it")
    if cfg.pp > 1 and cfg.micro_batch_size is None and cfg.dp and cfg.batch_size % cfg.dp == 0 \
            and (size := pipeline_micro_batch(cfg)) is not None:
        cfg.micro_batch_size = size
        say(f"note: --pp {cfg.pp}: {passes(cfg)} micro-batches of {size} sequence"
            f"{'s' * (size != 1)} a step (--micro-batch-size {size}; pass it to choose)")
    resume_from = None if ckpt is None else str(ckpt)
    check_before_ranks(cfg, recipe, resume_from)
    return cfg, recipe, resume_from


def resumed_checkpoint(out: str, resume: bool | None) -> Path | None:
    """The checkpoint ``--resume`` continues (None: none yet); for a new run, a refusal of an
    ``--out`` that holds another run."""
    if resume:
        if not Path(out).is_dir():
            raise ValueError(f"--resume: {out} does not exist, so there is no run to resume "
                             "(check --out, or leave out --resume to start a new run)")
        return find_checkpoint(out)
    if find_checkpoint(out) is not None:
        raise ValueError(f"{out} already holds checkpoints: pass --resume to continue that run, "
                         "or choose another --out")
    if (Path(out) / "metrics.jsonl").exists():
        raise ValueError(f"{out} holds the metrics.jsonl of an earlier run (no checkpoint): "
                         "pass --resume to start that run over, or choose another --out")
    return None


def check_before_ranks(cfg: TrainConfig, recipe, resume_from: str | None) -> None:
    """Everything that can be refused before a rank starts, refused here, in one line."""
    cfg.check()
    if cfg.cp > 1 and not getattr(recipe, "context_parallel", False):
        raise ValueError(f"--cp {cfg.cp}: context parallelism trains tensorpar's GPT; this "
                         f"model ({recipe.kind}) does not split its sequences yet")
    recipe.check(cfg)
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"--out {cfg.out} is a file, not a directory")
    if cfg.pack and cfg.data is None:
        raise ValueError("--pack packs chat or instruction examples into sequences: add --data "
                         "FILE.jsonl (without --data the run trains on text, Python's help "
                         "topics)")
    if cfg.pack and not is_chat_file(cfg.data):
        raise ValueError(f"--pack packs chat or instruction examples: --data {cfg.data} is not "
                         "a JSON-lines file (.jsonl) of examples")
    tokenizer = recipe.tokenizer()  # missing, short or unreadable data fails here, once
    for flag, path in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if flag == "--data" or path is not None:
            examples = check_corpus(path, tokenizer, cfg.seq_len, flag, cfg.skip_bad_examples)
            if examples is not None and examples.skipped:
                say(f"note: {flag}: skipping {len(examples.skipped)} malformed example"
                    f"{'s' * (len(examples.skipped) != 1)} (--skip-bad-examples); the first: "
                    f"{examples.skipped[0]}")
    if warning := overlap_warning(cfg.data, cfg.val_data):
        say(f"warning: {warning}")
    if cfg.val_data is None and (cfg.eval_every is not None or cfg.eval_batches is not None):
        raise ValueError("--eval-every and --eval-batches go with --val-data (the validation "
                         "text)")
    if resume_from is not None:
        CheckpointReader(resume_from).verify()  # a corrupted file too
    if cfg.compile:
        check_compile_device(cfg.tp, wanted_device())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.tp * cfg.dp * cfg.pp))
    if cfg.pp > 1 and rank_device_type(local_world) == "cuda" and \
            pick_backend(local_world) == "gloo":
        raise ValueError(f"--pp {cfg.pp} with the ranks on the GPU over gloo: gloo sends and "
                         "receives CPU tensors only (torch 2.11 aborts on a CUDA one), so "
                         "pipeline stages on GPUs need NCCL, a GPU per rank; or run them on the "
                         "CPU (--device cpu)")
    if note := tf32_note(cfg.tf32, cfg.dtype, rank_device_type(local_world)):
        say(f"note: {note}")


def _dp_size(cfg: TrainConfig, explicit: int | None) -> int:
    """--dp: as given; else, under torchrun, the world size / --tp (an error when --tp does not
    divide it); else the resumed run's, or 1."""
    if explicit is not None or not under_torchrun():
        return 1 if cfg.dp is None else cfg.dp  # --dp 0 stays 0, for check() to refuse
    world = int(os.environ.get("WORLD_SIZE", "1"))
    grid = cfg.tp * cfg.pp * cfg.cp  # the ranks of one data-parallel replica
    sizes = f"--tp {cfg.tp}" + (f" x --pp {cfg.pp}" if cfg.pp != 1 else "") + \
        (f" x --cp {cfg.cp}" if cfg.cp != 1 else "")
    if grid < 1 or world % grid:
        raise ValueError(f"torchrun started {world} processes, which {sizes} does not divide: "
                         f"start a multiple of {grid} in all (--nnodes x --nproc-per-node), or "
                         f"pass a {'--tp' if grid == cfg.tp else 'size'} that divides {world}")
    return world // grid


def say(line: str) -> None:
    """One line for the user, from one process: the launcher, or rank 0 under torchrun."""
    speak(f"tensorpar train: {line}", file=sys.stderr, flush=True)

