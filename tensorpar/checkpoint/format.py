"""The checkpoint format on disk: its names and constants, and how a run's checkpoints are found.

::

    RUN_DIR/step-00000200/
        manifest.json                    format, TP size, step, config, data position, RNG scheme,
                                         each tensor's dense shape, split dim and which rank's
                                         file holds which slice, each file's size and sha256
        rank00-of02.safetensors          the slices rank 0 owns (weights and AdamW moments)
        rank01-of02.safetensors

Each tensor's entry: ``{"shape", "dtype", "split_dim", "pieces": [{"rank", "start", "stop"}]}``;
a piece says that rank's file holds the dense rows [start, stop) of ``split_dim``. A rank may own
several ranges of one tensor (a fused dim: GPT-2's q|k|v, each block split alike); its file then
stacks them along ``split_dim`` and each piece after the first gives its ``offset`` there: rows
[offset, offset + stop - start) of the file's tensor. Every dense element is in exactly one piece.
Besides the parameters (and their AdamW moments), a checkpoint holds the buffers a run moves
(``checkpointed_buffers``: the GPT's MoE selection bias), each whole, in one file.

Versions: 1 has no ``offset`` (one range per rank and tensor); 2 may have it; 3 is a pipelined
run's (``pp_size`` stages, each of ``tp_size`` files: stage p's TP rank r wrote file
p · tp_size + r, and the pieces name those files); 4 is a run with routed experts and data
parallelism (``dp_size``): the experts held by other data ranks are written by those ranks, so
every rank of a stage writes a file, data rank d's TP rank r file (p · dp_size + d) · tp_size + r
(the others' tensors in data rank 0's files, as before). A routed expert's tensor (E, ...) has
split dim 0: each range of experts is written once, by the first rank that holds it, never by
the data ranks that hold copies of it. A checkpoint is written with the lowest version that
describes it, so older readers still read what they can, and refuse, rather than misread, the
rest.

No pickle: the format is JSON plus safetensors. ``save.py`` writes it, ``load.py`` reads it at any
TP size, ``export.py`` turns it into one dense file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FORMAT = "tensorpar-checkpoint"
DENSE_FORMAT = "tensorpar-dense"  # the metadata ``format`` of the one file ``export.py`` writes
VERSION = 4  # the newest version written and read
VERSIONS = (1, 2, 3, 4)  # read; 1: no piece has an offset, 3: pipeline stages, 4: experts'
# files from every data rank (module docstring)
ADAM_STATES = ("exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted or does not fit the model."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_readable(path: Path) -> None:
    """safetensors writes 0600; give the file the mode the user's umask asks for."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def checkpointed(model) -> list:
    """The (name, parameter) pairs a checkpoint of ``model`` holds: the trainable ones. Frozen
    parameters (a LoRA run's base model, which its manifest names) are not saved; a model with
    no trainable parameter at all (one prepared for inference) is saved whole."""
    params = list(model.named_parameters())
    trainable = [(n, p) for n, p in params if p.requires_grad]
    return trainable or params


def checkpointed_buffers(model) -> list:
    """The (name, buffer) pairs a checkpoint of ``model`` holds besides its parameters: the
    state a run moves outside the optimizer, the buffers each module lists in its
    ``checkpointed_buffers`` (names relative to it): the GPT's MoE blocks' selection bias, which
    loss-free balancing moves. Each is the same on every rank, so it is stored whole, as a
    replicated parameter is; a checkpoint without one (written before it was kept) leaves the
    model's as it is."""
    found = []
    for prefix, module in model.named_modules():
        for name in getattr(module, "checkpointed_buffers", ()):
            owner, _, attr = name.rpartition(".")
            t = module.get_submodule(owner)._buffers.get(attr)
            if t is not None:
                found.append((f"{prefix}.{name}" if prefix else name, t))
    return found


def model_kind(manifest: dict) -> str:
    """What model a checkpoint holds. ``tensorpar train``'s GPT runs record no ``model_kind``
    (they came first): "gpt". A run fine-tuned from a Hugging Face model (``train --hf``)
    records "hf" (``train/hf_recipe.py``); ``hf/export.py`` picks the exporter by it."""
    return str(manifest.get("model_kind", "gpt"))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with a manifest) under ``run_dir``, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    # a ".step-N.old" is complete: it exists only while a re-save of step N swaps directories
    found = [d for d in [*run_dir.glob("step-*"), *run_dir.glob(".step-*.old")]
             if (d / "manifest.json").is_file()]
    return sorted(found, key=lambda d: (int(d.name.strip(".").split("-")[1].split(".")[0]),
                                        d.name.startswith(".")))


def is_dense_export(path: str | Path) -> bool:
    """Whether ``path`` is a file ``tensorpar export`` wrote: a safetensors file whose header's
    metadata says ``DENSE_FORMAT`` (read from its first bytes; anything else is False)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")  # safetensors: the header's length first
            header = json.loads(f.read(size)) if 0 < size <= 1 << 24 else None
    except (OSError, ValueError):  # a directory, unreadable, not JSON
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get("format") == DENSE_FORMAT


def find_checkpoint(path: str | Path) -> Path | None:
    """``path`` itself if it is a checkpoint, else the newest one in the run directory."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None
