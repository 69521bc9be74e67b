"""A run fine-tuned from a Hugging Face model (``tensorpar train --hf``) written back as that
model, ``tensorpar export --ckpt RUN --hf-out DIR`` (``export.py`` checks the target and the
checkpoint first, and renames the finished folder into place)::

    checkpoint (manifest model_kind "hf")      the folder
    RUN/hf/config.json (the run's copy)   ->   config.json: the original architecture
    each weight, dense, under its HF name ->   model.safetensors (GPT-2's Conv1D weights back to
                                               their (in, out) layout; a tied head tied again)
    RUN/hf/generation_config.json         ->   generation_config.json (if the source had one)
    RUN/hf/ tokenizer files               ->   copied as they are

The weights are written by transformers' own ``save_pretrained`` (split, with an index, above
``--max-shard-size``), in float32: the trainer's master weights, whatever dtype the source was
stored in (a note says so when it was another). A LoRA run's checkpoint holds its adapters: it is
written as its base model (the folder the run names) with each adapter merged in,
``W + (alpha / r) · B A``; ``export --peft-out`` writes the adapters alone, as PEFT's folder.
Also the writer of every export (``save_model``) and the check that a checkpoint holds a model's
tensors (``check_tensors``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.hf.lora import checkpoint_factors, lora_settings, merge_factors
from tensorpar.hf.plans import is_conv1d

Note = Callable[[str], None]
Writer = Callable[[Path], None]
# written by save_pretrained from the model: not copied from the run's files
WRITTEN = ("config.json", "generation_config.json")


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off (loading and writing weights), as they were after."""
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def save_model(model, folder: Path, max_shard_size: int) -> None:
    """``model.save_pretrained(folder)`` without transformers' progress bars."""
    with no_progress_bars():
        model.save_pretrained(folder, max_shard_size=max_shard_size)


def check_tensors(reader: CheckpointReader, names: dict, model: str) -> None:
    """The checkpoint's weights must be exactly ``names`` (checkpoint name -> (name in the
    folder, dense shape)), shape for shape. model: what the folder holds, for the message."""
    have = {k: tuple(e["shape"]) for k, e in reader.tensors.items()
            if not k.startswith("optimizer.")}
    extra, missing = sorted(have.keys() - names.keys()), sorted(names.keys() - have.keys())
    if extra:
        raise ValueError(f"checkpoint {reader.dir}: {extra[0]} has no place in {model} of its "
                         f"config ({len(extra)} such tensor{'s' * (len(extra) > 1)})")
    if missing:
        raise ValueError(f"checkpoint {reader.dir} has no {missing[0]}, which its config needs")
    for name, (_, shape) in names.items():
        if have[name] != shape:
            raise ValueError(f"checkpoint {reader.dir}: {name} is {have[name]}; its config "
                             f"makes it {shape}")


def run_files(reader: CheckpointReader) -> Path:
    """The run's copy of its source model's files (``RUN/hf/``), next to its checkpoints."""
    files = reader.dir.parent / str((reader.manifest.get("hf") or {}).get("files", "hf"))
    if not (files / "config.json").is_file():
        raise ValueError(f"checkpoint {reader.dir}: no {files / 'config.json'}, the copy of the "
                         "model's files that tensorpar train --hf makes at the start of a run")
    return files


def original_model(reader: CheckpointReader, max_shard_size: int, note: Note) -> Writer:
    """Check that the checkpoint holds the model of its run's config; return what writes its
    folder (see the module docstring)."""
    import transformers
    from accelerate import init_empty_weights

    transformers.logging.set_verbosity_error()
    files = run_files(reader)
    if lora_settings(reader.manifest) is not None:
        return merged_lora_model(reader, files, max_shard_size)
    config = transformers.AutoConfig.from_pretrained(files, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # no weight drawn: each is assigned below
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # on the meta device, a tied head is tied only now
    # the trainer's layers hold GPT-2's Conv1D weights as nn.Linear does: (out, in)
    conv = {f"{n}.weight" for n, m in model.named_modules() if is_conv1d(m)}
    shapes = {n: tuple(p.shape[::-1] if n in conv else p.shape)
              for n, p in model.named_parameters()}  # a tied head once, under the embedding
    check_tensors(reader, {n: (n, shape) for n, shape in shapes.items()}, type(model).__name__)
    saved = json.loads((files / "config.json").read_text())
    stored = saved.get("dtype") or saved.get("torch_dtype")
    if stored not in (None, "float32"):
        note(f"the weights are written in float32 (the trainer's master weights); the source "
             f"model was stored in {stored}")

    def write(folder: Path) -> None:
        state = {n: (reader.read(n).t() if n in conv else reader.read(n)).contiguous()
                 for n in shapes}
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()  # the head shares the embedding it was trained with
        empty = [n for n, p in model.named_parameters() if p.is_meta]
        if empty:
            raise ValueError(f"checkpoint {reader.dir}: {empty[0]} of {type(model).__name__} "
                             "has no tensor in it")
        if (files / "generation_config.json").is_file():
            model.generation_config = transformers.GenerationConfig.from_pretrained(files)
        save_model(model, folder, max_shard_size)
        copy_tokenizer(files, folder)

    return write


def copy_tokenizer(files: Path, folder: Path) -> None:
    """The run's copies of the source's files but those save_pretrained writes (the
    tokenizer's) into ``folder``."""
    for f in sorted(files.iterdir()):
        if f.is_file() and f.name not in WRITTEN:
            shutil.copy2(f, folder / f.name)


def merged_lora_model(reader: CheckpointReader, files: Path, max_shard_size: int) -> Writer:
    """A LoRA run as its base model with each adapter merged in, ``W + (alpha / r) · B A``: the
    base read from the folder the run names, in float32."""
    import transformers

    settings = lora_settings(reader.manifest)
    base = settings["base"]
    if base is None or not (Path(base) / "config.json").is_file():
        raise ValueError(f"checkpoint {reader.dir}: its base model {base} is not there; the "
                         "merged model needs it (export --peft-out needs only the checkpoint)")
    factors = checkpoint_factors(reader)

    def write(folder: Path) -> None:
        with no_progress_bars():
            model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        conv = {n for n, m in model.named_modules() if is_conv1d(m)}
        state = model.state_dict()
        merge_factors(state, factors, settings["alpha"] / settings["rank"], conv)
        model.load_state_dict(state)
        save_model(model, folder, max_shard_size)
        copy_tokenizer(files, folder)

    return write
