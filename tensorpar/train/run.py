"""Starting a training run from the command line: the recipe of its kind chosen in one lookup
(:func:`resolve`: the GPT or a Hugging Face model, by ``--hf`` or the run resumed; each recipe
merges the flags with that run through ``resume.py``), the ranks launched (:func:`run_train`),
and one line on how a run that was stopped early ended.

Stopping: SIGTERM or SIGUSR1 (a cluster's preemption) finishes the step in flight, saves and exits
with 128 + the signal; Ctrl-C, or a second signal, stops every rank at once (exit 130) and says
which checkpoint is left and how to resume.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tensorpar.checkpoint.format import find_checkpoint, model_kind
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.checkpoint.save import remove_unfinished
from tensorpar.ranks.local import run_ranks
from tensorpar.ranks.signals import STOP_SIGNALS, Interrupted, ignore_stops, signal_name
from tensorpar.runtime.torchrun import speaks, under_torchrun
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import resolve_gpt
from tensorpar.train.hf_recipe import resolve_hf, started_as_hf_run
from tensorpar.train.loop import train_model_rank
from tensorpar.train.report import Metrics
from tensorpar.train.resume import RunFlags, say

# each kind of run (a checkpoint's model_kind) and what resolves it from the command line
RECIPES = {"gpt": resolve_gpt, "hf": resolve_hf}


def resolve(train_args: dict, model_args: dict, hf: str | None = None,
            tokenizer: str | None = None):
    """The run ``tensorpar train`` asked for: (config, recipe, checkpoint to resume or None),
    from the recipe of its kind (:data:`RECIPES`). The GPT from its model flags and
    ``--tokenizer``, or a Hugging Face model with ``--hf PATH``; on ``--resume`` whichever the
    run in ``--out`` holds (a fine-tune needs no ``--hf`` then)."""
    flags = RunFlags(train_args, model_args, hf, tokenizer)
    return RECIPES[run_kind(flags)](flags)


def run_kind(flags: RunFlags) -> str:
    """"hf" for ``--hf``; on ``--resume``, the kind of the run in ``--out``: its newest
    checkpoint's ``model_kind``, or, before its first, "hf" if it keeps a copy of its model's
    files (``hf_recipe.started_as_hf_run``); else "gpt"."""
    if flags.hf is not None:
        return "hf"
    if not flags.train.get("resume"):
        return "gpt"
    out = flags.train.get("out") or TrainConfig.out
    ckpt = find_checkpoint(out)
    if ckpt is None:
        return "hf" if started_as_hf_run(out) else "gpt"
    kind = model_kind(CheckpointReader(ckpt).manifest)
    return kind if kind in RECIPES else "gpt"  # the GPT's recipe refuses another kind


def run_train(cfg: TrainConfig, recipe, resume_from: str | None) -> int:
    """Spawn ``cfg.tp`` x ``cfg.dp`` local ranks, or, under torchrun, be one of its ranks, to
    train the model of ``recipe`` (``GPTRecipe(model_cfg)`` for the GPT). Returns the exit
    status: 0, or 128 + the signal that stopped the run (SIGTERM: 143, Ctrl-C: 130)."""
    ranks = cfg.tp * (cfg.dp or 1) * cfg.pp * cfg.cp
    world = int(os.environ.get("WORLD_SIZE", ranks))
    if under_torchrun() and world != ranks:
        raise ValueError(f"torchrun started {world} processes but --tp {cfg.tp} x --dp "
                         f"{cfg.dp or 1} x --pp {cfg.pp} x --cp {cfg.cp} is {ranks}: start "
                         f"{ranks} in all (torchrun --nnodes x --nproc-per-node), or change "
                         "--tp / --dp / --pp / --cp")
    if cfg.resume and resume_from is None:
        say(f"no checkpoint in {cfg.out}; starting from step 0")
    elif resume_from is not None:
        say(f"resuming from {resume_from}")
        done = CheckpointReader(resume_from).manifest["step"]
        if done >= cfg.steps:
            say(f"{cfg.out} is already at step {done} (--steps {cfg.steps}): nothing to train; "
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
            say(_interrupted(signum, Path(cfg.out)))
        return 128 + signum
    if stopped is None:
        return 0
    # said here, once the ranks are done: a second signal while they save or leave stops them at
    # once (above), and that line is the only one
    say(f"stopped by {stopped['signal']} after step {stopped['step']}; saved "
         f"{find_checkpoint(Path(cfg.out))}; resume with: tensorpar train --resume --out {cfg.out}")
    return 128 + stopped["signum"]


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
