"""Starting a training run from the command line: the flags merged with the run being resumed
(:func:`resolve`; :func:`resolve_run` for any model's recipe), the ranks launched
(:func:`run_train`), and one line on how a run that was stopped early ended.

Resuming keeps the run's settings, its learning-rate schedule included (``--lr-decay-steps``,
stored in the manifest), so ``--steps 400`` then ``--resume --steps 800`` repeats one run of
``--steps 800 --lr-decay-steps 400`` step for step.

Stopping: SIGTERM or SIGUSR1 (a cluster's preemption) finishes the step in flight, saves and exits
with 128 + the signal; Ctrl-C, or a second signal, stops every rank at once (exit 130) and says
which checkpoint is left and how to resume.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tensorpar.checkpoint.format import find_checkpoint, model_kind
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.checkpoint.save import remove_unfinished
from tensorpar.data.chat import is_chat_file
from tensorpar.data.text import check_corpus
from tensorpar.ranks.local import run_ranks
from tensorpar.ranks.signals import STOP_SIGNALS, Interrupted, ignore_stops, signal_name
from tensorpar.runtime.groups import pick_backend, rank_device_type, wanted_device
from tensorpar.runtime.torchrun import speaks, under_torchrun
from tensorpar.train.compute import check_compile_device, tf32_note
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.history import resume_notes, saved_settings
from tensorpar.train.loop import train_model_rank
from tensorpar.train.report import Metrics

# settings whose change makes a resumed run something else than the original's continuation
_SAME_RUN = ("seed", "batch_size", "seq_len", "data", "lr", "dtype", "warmup_steps",
             "lr_decay_steps", "tf32")


def resolve(train_args: dict, model_args: dict, hf: str | None = None,
            tokenizer: str | None = None):
    """The run ``tensorpar train`` asked for: (config, recipe, checkpoint to resume or None).
    The GPT from its model flags and ``--tokenizer``, or a Hugging Face model with ``--hf PATH``;
    on ``--resume`` whichever the run in ``--out`` holds (a fine-tune needs no ``--hf`` then)."""
    if hf is not None or (train_args.get("resume") and _resumes_hf(train_args.get("out"))):
        from tensorpar.train.hf_recipe import resolve_hf

        if tokenizer is not None:
            raise ValueError("--tokenizer is the GPT's: a fine-tune reads text with its own "
                             "model's tokenizer")
        return resolve_hf(train_args, model_args, hf)
    return resolve_run(train_args, partial(GPTRecipe.from_flags, model_args, tokenizer,
                                           train_args.get("data")))


def _resumes_hf(out: str | None) -> bool:
    """Whether the run in ``out`` is a fine-tune: by its newest checkpoint, or, before its
    first, by the copy of its model's files it keeps (``hf_recipe.started_as_hf_run``)."""
    ckpt = find_checkpoint(out or TrainConfig.out)
    if ckpt is not None:
        return model_kind(CheckpointReader(ckpt).manifest) == "hf"
    from tensorpar.train.hf_recipe import started_as_hf_run

    return started_as_hf_run(out)


def resolve_run(train_args: dict, recipe_for: Callable) -> tuple[TrainConfig, object, str | None]:
    """Merge explicit flags with the checkpoint being resumed and the defaults; validate.
    Returns the training config, the model's recipe (``gpt_recipe.py``) and the checkpoint to
    resume.

    recipe_for(manifest, ckpt): the recipe of the run, from its flags (manifest None: a new run)
    or from the checkpoint being resumed. On resume, training settings default to the
    checkpoint's, so the resumed run repeats the original. Explicit flags still win for the
    settings that may change (steps, tp, ...).
    """
    explicit = {k: v for k, v in train_args.items() if v is not None}
    ckpt = _resumed_checkpoint(explicit.get("out", TrainConfig.out), explicit.get("resume"))
    manifest = None if ckpt is None else CheckpointReader(ckpt).manifest
    saved = {} if manifest is None else saved_settings(manifest)
    for line in [] if manifest is None else resume_notes(manifest, ckpt):
        _say(f"note: {line}")
    recipe = recipe_for(manifest, ckpt)
    changed = [k for k in _SAME_RUN if k in explicit and k in saved and explicit[k] != saved[k]]
    if changed:
        _say(f"note: {', '.join('--' + k.replace('_', '-') for k in changed)} "
             "differ from the checkpoint's; the resumed run is not an exact continuation")
    cfg = TrainConfig(**(saved | explicit))
    cfg.dp = _dp_size(cfg, explicit.get("dp"))
    if cfg.lr_decay_steps is None:  # a new run: decay over its --steps, stored in its manifest
        cfg.lr_decay_steps = cfg.steps
    elif ("steps" in explicit and explicit["steps"] != saved.get("steps")
          and "lr_decay_steps" not in explicit):
        _say(f"note: keeping the run's learning-rate schedule (cosine decay to "
             f"lr/10 at step {cfg.lr_decay_steps}, constant after); pass --lr-decay-steps to "
             "change it")
    resume_from = None if ckpt is None else str(ckpt)
    _check_before_ranks(cfg, recipe, resume_from)
    return cfg, recipe, resume_from


def _resumed_checkpoint(out: str, resume: bool | None) -> Path | None:
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


def _check_before_ranks(cfg: TrainConfig, recipe, resume_from: str | None) -> None:
    """Everything that can be refused before a rank starts, refused here, in one line."""
    cfg.check()
    recipe.check(cfg)
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"--out {cfg.out} is a file, not a directory")
    if cfg.pack and not is_chat_file(cfg.data):
        raise ValueError(f"--pack packs chat or instruction examples: --data {cfg.data} is not "
                         "a JSON-lines file of {\"messages\"} or {\"prompt\", \"completion\"}")
    tokenizer = recipe.tokenizer()  # missing, short or unreadable data fails here, once
    check_corpus(cfg.data, tokenizer, cfg.seq_len)
    if cfg.val_data is not None:
        check_corpus(cfg.val_data, tokenizer, cfg.seq_len, "--val-data")
    elif cfg.eval_every is not None or cfg.eval_batches is not None:
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
        _say(f"note: {note}")


def _dp_size(cfg: TrainConfig, explicit: int | None) -> int:
    """--dp: as given; else, under torchrun, the world size / --tp (an error when --tp does not
    divide it); else the resumed run's, or 1."""
    if explicit is not None or not under_torchrun():
        return 1 if cfg.dp is None else cfg.dp  # --dp 0 stays 0, for check() to refuse
    world = int(os.environ.get("WORLD_SIZE", "1"))
    grid = cfg.tp * cfg.pp  # the ranks of one data-parallel replica
    sizes = f"--tp {cfg.tp}" + (f" x --pp {cfg.pp}" if cfg.pp != 1 else "")
    if grid < 1 or world % grid:
        raise ValueError(f"torchrun started {world} processes, which {sizes} does not divide: "
                         f"start a multiple of {grid} in all (--nnodes x --nproc-per-node), or "
                         f"pass a {'--tp' if cfg.pp == 1 else 'size'} that divides {world}")
    return world // grid


def run_train(cfg: TrainConfig, recipe, resume_from: str | None) -> int:
    """Spawn ``cfg.tp`` x ``cfg.dp`` local ranks, or, under torchrun, be one of its ranks, to
    train the model of ``recipe`` (``GPTRecipe(model_cfg)`` for the GPT). Returns the exit
    status: 0, or 128 + the signal that stopped the run (SIGTERM: 143, Ctrl-C: 130)."""
    ranks = cfg.tp * (cfg.dp or 1) * cfg.pp
    world = int(os.environ.get("WORLD_SIZE", ranks))
    if under_torchrun() and world != ranks:
        raise ValueError(f"torchrun started {world} processes but --tp {cfg.tp} x --dp "
                         f"{cfg.dp or 1} x --pp {cfg.pp} is {ranks}: start {ranks} in all "
                         "(torchrun --nnodes x --nproc-per-node), or change --tp / --dp / --pp")
    if cfg.resume and resume_from is None:
        _say(f"no checkpoint in {cfg.out}; starting from step 0")
    elif resume_from is not None:
        _say(f"resuming from {resume_from}")
        done = CheckpointReader(resume_from).manifest["step"]
        if done >= cfg.steps:
            _say(f"{cfg.out} is already at step {done} (--steps {cfg.steps}): nothing to train; "
                 "pass a larger --steps to continue it")
            return 0
    try:
        results = run_ranks(train_model_rank, ranks, cfg, recipe, resume_from,
                            forward_signals=STOP_SIGNALS)
        stopped = results[0]["stopped"]  # every rank's, under torchrun: all end alike
        if stopped is not None:  # saved and said below: a signal from now on changes nothing
            ignore_stops()
    except KeyboardInterrupt as e:  # Ctrl-C, or a second SIGTERM: the ranks stopped at once
        ignore_stops()  # one line: a signal that comes while this process leaves is ignored
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if speaks():
            remove_unfinished(cfg.out)
            _say(_interrupted(signum, Path(cfg.out)))
        return 128 + signum
    if stopped is None:
        return 0
    # said here, once the ranks are done: a second signal while they save or leave stops them at
    # once (above), and that line is the only one
    _say(f"stopped by {stopped['signal']} after step {stopped['step']}; saved "
         f"{find_checkpoint(Path(cfg.out))}; resume with: tensorpar train --resume --out {cfg.out}")
    return 128 + stopped["signum"]


def _say(line: str) -> None:
    """One line for the user, from one process: the launcher, or rank 0 under torchrun."""
    if speaks():
        print(f"tensorpar train: {line}", file=sys.stderr, flush=True)


def _interrupted(signum: int, out: Path) -> str:
    """What a run stopped at once has kept: its last step, checkpoint, and how to go on."""
    how = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
    rows = Metrics.read(out / "metrics.jsonl")
    last = rows[-1]["step"] if rows else 0
    ckpt = find_checkpoint(out) if out.is_dir() else None
    if ckpt is None:
        return (f"interrupted ({how}) after step {last}, before the first checkpoint: nothing "
                "was saved; run the same command with --resume to start it over")
    saved = CheckpointReader(ckpt).manifest["step"]
    lost = f"; steps {saved + 1}-{last} are lost" if last > saved else ""
    return (f"interrupted ({how}) after step {last}; last checkpoint {ckpt} (step {saved})"
            f"{lost}; resume with: tensorpar train --resume --out {out}")
