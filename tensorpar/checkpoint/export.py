"""Exporting a sharded checkpoint as one dense safetensors file.

The target is checked before anything is read or written (``check_export_target``): it must
name a ``.safetensors`` file, not a directory, in a directory that exists and is writable. The
file is then written under a hidden temporary name next to it and renamed into place
(``write_atomically``), so a failed or interrupted export leaves the old file, if any, and no
temporary file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from tensorpar.checkpoint.format import DENSE_FORMAT, make_readable
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.runtime.output import write_atomically


def check_export_target(out_file: str | Path) -> Path:
    """``out_file`` as a Path, or ValueError (one line naming ``--out``) if it cannot be written:
    a directory, not ending in .safetensors, in a missing or unwritable directory."""
    out = Path(out_file)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name the file to write, e.g. "
                         f"--out {out / 'model.safetensors'}")
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out}: expected a file name ending in .safetensors")
    parent = out.parent
    if not parent.exists():
        raise ValueError(f"--out {out}: directory {parent} does not exist")
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: directory {parent} is not writable")
    return out


def export_dense(path: str | Path, out_file: str | Path) -> Path:
    """Write every weight of the checkpoint, unsharded, to one safetensors file (atomically).

    Raises ValueError (one line) for a target that cannot be written, a checkpoint that cannot
    be read, or a write that fails (disk full, permissions); nothing is left behind then."""
    out_file = check_export_target(out_file)
    reader = CheckpointReader(path)
    tensors = {k: reader.read(k).contiguous() for k in reader.tensors
               if not k.startswith("optimizer.")}
    meta = {"format": DENSE_FORMAT, "step": str(reader.manifest["step"]),
            "config": json.dumps(reader.manifest.get("config", {}))}

    def write(tmp: Path) -> None:
        save_file(tensors, tmp, metadata=meta)
        make_readable(tmp)

    try:
        write_atomically(out_file, write)
    except WRITE_ERRORS as e:  # the checks passed, the write did not (disk full)
        raise cannot_write("--out", out_file, e) from None
    return out_file


WRITE_ERRORS = (OSError, SafetensorError)


def cannot_write(flag: str, target: Path, e: Exception) -> ValueError:
    """The one line for an export whose checks passed but whose write failed (a full disk)."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return ValueError(f"{flag} {target}: cannot write it ({why})")
