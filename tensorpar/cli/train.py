"""``tensorpar train``: its flags are the fields of ``TrainConfig`` and ``GPTConfig``, one per
field, with the field's help; a flag not given is None, so that a resumed run can tell what was
asked for from what it keeps (``train/run.py``)::

    tensorpar train --tp 2 --steps 300 --out runs/gpt
    tensorpar train --hf ./my-llama --tp 2 --steps 200 --data notes.txt --out runs/ft
    tensorpar train --resume --tp 4 --steps 600 --out runs/gpt
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing


def add_parser(sub) -> None:
    from tensorpar.gpt.model import GPTConfig
    from tensorpar.train.config import TrainConfig

    p = sub.add_parser("train", help="train the GPT, or fine-tune a Hugging Face model, with "
                       "tensor parallelism")
    p.add_argument("--hf", metavar="PATH", help="fine-tune this local Hugging Face causal LM "
                   "(config.json, safetensors, tokenizer) instead of the GPT, without model "
                   "flags; --resume needs no --hf (the run copies the files to --out's hf/) "
                   "(default: none, the GPT)")
    p.add_argument("--tokenizer", metavar="DIR", help="the GPT's tokenizer: a local Hugging "
                   "Face tokenizer folder (tokenizer.json, ...); the vocabulary size follows it, "
                   "and the run keeps a copy that generate and export use (default: that of "
                   "the shard folder --data names, else UTF-8 bytes)")
    add_dataclass_flags(p, TrainConfig, "training")
    add_dataclass_flags(p, GPTConfig, "model (taken from the checkpoint on --resume)")
    p.set_defaults(func=run)


def add_dataclass_flags(p: argparse.ArgumentParser, cls, title: str) -> None:
    """One flag per field of ``cls``, typed by its annotation, default None (so that the trainer
    can tell what was given explicitly); bools as ``--x`` / ``--no-x``."""
    g = p.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        kind = _scalar(hints[f.name])
        default = f.metadata.get("default", f.default)
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           dest=f.name, help=f"{f.metadata['help']} (default "
                           f"{'on' if default else 'off'})")
        else:
            g.add_argument(flag, type=kind, default=None, dest=f.name,
                           help=f"{f.metadata['help']} (default {default})")


def _scalar(hint) -> type:
    """``int`` for ``int`` and for ``int | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def run(args) -> int:
    """Resolve the run (a new one, or the one ``--resume`` continues: the GPT or a fine-tuned HF
    model) and train it."""
    from tensorpar.gpt.model import GPTConfig
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.run import resolve, run_train

    pick = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # noqa: E731
    cfg, recipe, resume_from = resolve(pick(TrainConfig), pick(GPTConfig), args.hf,
                                        args.tokenizer)
    return run_train(cfg, recipe, resume_from)
