"""Exporting a sharded checkpoint as one dense safetensors file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from tensorpar.checkpoint.format import make_readable
from tensorpar.checkpoint.load import CheckpointReader


def export_dense(path: str | Path, out_file: str | Path) -> Path:
    """Write every weight of the checkpoint, unsharded, to one safetensors file (atomically)."""
    reader = CheckpointReader(path)
    tensors = {k: reader.read(k).contiguous() for k in reader.tensors
               if not k.startswith("optimizer.")}
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    meta = {"format": "tensorpar-dense", "step": str(reader.manifest["step"]),
            "config": json.dumps(reader.manifest.get("config", {}))}
    save_file(tensors, tmp, metadata=meta)
    make_readable(tmp)
    os.replace(tmp, out_file)
    return out_file
