"""What ``tensorpar plan --config`` reads of its file or folder: which JSON file it names (a
run's folder means its newest checkpoint's manifest, as ``generate`` and ``export`` read it),
and, from a checkpoint's manifest, the settings its run trained with, which stand in for the
plan flags not given.

A flag given explicitly wins over the run's setting; a setting the run does not have (a
Hugging Face config.json, a GPTConfig file) leaves plan's own default.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorpar.checkpoint.format import find_checkpoint, model_kind
from tensorpar.planner.step import Lora

# plan's defaults for the flags a run's settings may fill (None on the command line: not given)
DEFAULTS = {"dtype": "bf16", "recompute": "none", "sequence_parallel": False, "dp": 1,
            "dp_mode": "fsdp", "pp_virtual": 1}


def config_file(config: str) -> Path:
    """The JSON file ``--config`` names: a file as it is; a checkpoint's directory its
    manifest.json; a run's folder its newest checkpoint's manifest.json; another directory its
    config.json."""
    path = Path(config)
    if not path.is_dir():
        return path
    if (path / "manifest.json").exists():
        return path / "manifest.json"
    checkpoint = find_checkpoint(path)
    return path / "config.json" if checkpoint is None else checkpoint / "manifest.json"


def run_settings(path: Path) -> tuple[dict, bool]:
    """A checkpoint manifest's training settings (``TrainConfig``'s fields; {} for another
    file) and whether its model is a Hugging Face one."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, False
    if not isinstance(manifest, dict) or not isinstance(manifest.get("train"), dict):
        return {}, False
    return manifest["train"], model_kind(manifest) == "hf"


def apply_run_settings(args) -> None:
    """Fill ``args``' plan flags that were not given from ``--config``'s run (its precision,
    layout, batch and passes, recomputation, sequence parallelism, LoRA, packing), then from
    plan's ``DEFAULTS``. Sets ``args.lora``, ``args.packed`` and ``args.converted`` (what
    ``step_from_flags`` reads) and ``args.run_settings`` (the run's settings, {} for none)."""
    train, hf = run_settings(config_file(args.config)) if args.config else ({}, False)
    args.run_settings = train
    given = {}
    if train:
        if args.batch is None:
            args.batch = train.get("batch_size")
        if args.seq is None:
            args.seq = train.get("seq_len")
        given = {"dtype": "bf16-autocast" if train.get("dtype") == "bf16" else "fp32",
                 "recompute": "full" if train.get("recompute") else "none",
                 "sequence_parallel": bool(train.get("sequence_parallel"))}
        if args.devices is None:  # a search chooses the layout itself
            given |= {"dp": train.get("dp") or 1, "dp_mode": train.get("dp_mode", "fsdp"),
                      "pp_virtual": train.get("pp_virtual", 1)}
            if args.tp is None:  # the run's layout (TP sizes given: their rows, one pass)
                args.tp = str(train.get("tp", 1))
                if args.pp is None and train.get("pp", 1) > 1:
                    args.pp = train["pp"]
                if args.micro_batch_size is None and args.micro_batches is None:
                    args.micro_batch_size = train.get("micro_batch_size")
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, given.get(name, default))
    rank = train.get("lora_rank")
    args.lora = None if rank is None else Lora(rank, train.get("lora_targets"),
                                               train.get("base_dtype", "fp32"),
                                               train.get("lora_dropout") or 0.0)
    args.packed, args.converted = bool(train.get("pack")), hf or None
