"""Sharded checkpoints that load at any TP size: one safetensors file per rank and a JSON manifest.

::

    RUN_DIR/step-00000200/
        manifest.json                    format, TP size, step, config, data position, RNG scheme,
                                         each tensor's dense shape, split dim and which rank's
                                         file holds which slice, each file's size and sha256
        rank00-of02.safetensors          the slices rank 0 owns (weights and AdamW moments)
        rank01-of02.safetensors

Each rank writes only what it owns (see ``layout.py``): replicated tensors once, shared KV heads
once. Loading reads, for every parameter of the model being loaded, the dense slice its rank needs
from whichever files hold it, so a checkpoint saved at TP=2 resumes at TP=1 or 4. No pickle: the
format is JSON plus safetensors.

Writes are atomic: ranks write into ``.step-N.tmp/``, rank 0 adds the manifest last and renames
the directory into place. A kill during a save leaves the previous checkpoint as it was; the
newest ``step-*`` directory with a manifest is the one loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.distributed import tp_rank, tp_size
from tensorpar.layout import Layout, owned_local
from tensorpar.sharding import dense_shape

FORMAT = "tensorpar-checkpoint"
VERSION = 1
ADAM_STATES = ("exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted or does not fit the model."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _barrier(group):
    if tp_size(group) > 1:
        dist.barrier(group=group)


def _fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _readable(path: Path) -> None:
    """safetensors writes 0600; give the file the mode the user's umask asks for."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, layout: Layout,
                    optimizer: torch.optim.Optimizer | None = None,
                    group: ProcessGroup | None = None, meta: dict | None = None,
                    keep: int = 2) -> Path:
    """Write ``RUN_DIR/step-{step}``; every rank of ``group`` calls it. Keeps the newest ``keep``
    checkpoints. ``meta`` (JSON-serializable) goes into the manifest. Returns the directory."""
    rank, n = tp_rank(group), tp_size(group)
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step-{step:08d}", run_dir / f".step-{step:08d}.tmp"
    if rank == 0:
        for stale in run_dir.glob(".step-*.tmp"):  # left by saves that were killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    tensors = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, t in [(name, p.detach())] + [(f"optimizer.{s}.{name}", state[s])
                                              for s in ADAM_STATES if s in state]:
            mine = owned_local(layout, name, t, rank)
            if mine is not None:
                tensors[key] = mine.detach().to("cpu", copy=True).contiguous()
    fname = f"rank{rank:02d}-of{n:02d}.safetensors"
    save_file(tensors, tmp / fname, metadata={"format": FORMAT, "rank": str(rank)})
    _readable(tmp / fname)
    _fsync(tmp / fname)
    info = {"name": fname, "bytes": (tmp / fname).stat().st_size, "sha256": _sha256(tmp / fname),
            "keys": sorted(tensors)}
    infos = [info]
    if n > 1:
        infos = [None] * n
        dist.all_gather_object(infos, info, group=group)
    if rank == 0:
        manifest = _manifest(step, n, model, layout, optimizer, infos, meta or {})
        _write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1))
        _fsync(tmp)
        old = run_dir / f".step-{step:08d}.old"
        if final.exists():  # the same step saved again: swap (the .old still counts until
            shutil.rmtree(old, ignore_errors=True)  # the new one is in place), drop the old
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(run_dir)
        shutil.rmtree(old, ignore_errors=True)
        for stale in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier(group)
    return final


def _manifest(step, n, model, layout, optimizer, infos, meta) -> dict:
    tensors = {}
    for name, p in model.named_parameters():
        pieces = []
        for r in range(n):
            owned = layout.owned(name, r)
            if owned is not None:
                pieces.append({"rank": r, "start": owned[0], "stop": owned[1]})
        entry = {"shape": list(layout.shapes[name]), "dtype": str(p.dtype).removeprefix("torch."),
                 "split_dim": layout.shards[name][0].dim, "pieces": pieces}
        tensors[name] = entry
        if optimizer is not None and optimizer.state.get(p):
            for s in ADAM_STATES:
                tensors[f"optimizer.{s}.{name}"] = entry
    files = [{k: v for k, v in info.items() if k != "keys"} for info in infos]
    opt = None
    if optimizer is not None:
        opt = {"type": type(optimizer).__name__, "step": step,
               "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                for g in optimizer.param_groups]}
    return {"format": FORMAT, "version": VERSION, "tp_size": n, "step": step, **meta,
            "optimizer": opt, "files": files, "tensors": tensors}


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


def find_checkpoint(path: str | Path) -> Path | None:
    """``path`` itself if it is a checkpoint, else the newest one in the run directory."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None


class CheckpointReader:
    """Reads dense slices of a checkpoint's tensors, whatever TP size wrote it. Each file is
    checked against the manifest's sha256 the first time it is opened."""

    def __init__(self, path: str | Path, check_hashes: bool = True):
        self.check_hashes = check_hashes
        found = find_checkpoint(path)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path} (expected manifest.json or "
                                  "step-*/manifest.json)")
        self.dir = found
        try:
            self.manifest = json.loads((found / "manifest.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{found}/manifest.json is corrupted: {e}") from None
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            what = (f"format={m.get('format')!r}, version={m.get('version')!r}"
                    if isinstance(m, dict) else f"a JSON {type(m).__name__}")
            raise CheckpointError(f"{found}: not a {FORMAT} v{VERSION} checkpoint ({what})")
        shape = {"tp_size": int, "step": int, "config": dict, "files": list, "tensors": dict}
        bad = [k for k, t in shape.items() if not isinstance(m.get(k), t)]
        if bad or len(m["files"]) != m["tp_size"]:
            raise CheckpointError(f"{found}/manifest.json is corrupted: "
                                  f"{'missing or invalid ' + ', '.join(bad) if bad else ''}"
                                  f"{'' if bad else 'files do not match tp_size'}")
        self.tensors: dict[str, dict] = m["tensors"]
        self._files: dict[int, object] = {}

    def verify(self) -> None:
        """Check every file against the manifest now (loading checks each file it opens)."""
        for rank in range(len(self.manifest["files"])):
            self._file(rank)

    def _file(self, rank: int):
        if rank not in self._files:
            info = self.manifest["files"][rank]
            path = self.dir / info["name"]
            if not path.is_file():
                raise CheckpointError(f"{self.dir}: {info['name']} is missing")
            size = path.stat().st_size
            digest = _sha256(path) if self.check_hashes or size != info["bytes"] else None
            if size != info["bytes"] or (digest is not None and digest != info["sha256"]):
                raise CheckpointError(
                    f"{self.dir}: {info['name']} is corrupted ({size} bytes, sha256 "
                    f"{(digest or '?')[:12]}..., the manifest says {info['bytes']} bytes, "
                    f"{info['sha256'][:12]}...)")
            self._files[rank] = safe_open(path, framework="pt")
        return self._files[rank]

    def read(self, key: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """The dense tensor ``key``, narrowed to [start, stop) along ``dim`` (None: all of it)."""
        entry = self.tensors[key]
        shape = list(entry["shape"])
        if dim is not None:
            stop = shape[dim] if stop is None else stop
            shape[dim] = stop - start
        out = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        filled, sdim = 0, entry["split_dim"]
        for piece in entry["pieces"]:
            src = self._file(piece["rank"]).get_slice(key)
            a, b = piece["start"], piece["stop"]
            if sdim is None:  # replicated: the whole tensor, in one file
                whole = src[:]
                return whole if dim is None else whole.narrow(dim, start, stop - start)
            if dim == sdim:  # the same split: read only the overlap
                lo, hi = max(a, start), min(b, stop)
                if lo >= hi:
                    continue
                index = (slice(None),) * dim + (slice(lo - a, hi - a),)
                out.narrow(dim, lo - start, hi - lo).copy_(src[index])
                filled += hi - lo
            else:  # another split dim (or the whole tensor): place the piece where it goes
                piece_t = src[:] if dim is None else src[:].narrow(dim, start, stop - start)
                out.narrow(sdim, a, b - a).copy_(piece_t)
                filled += b - a
        expected = shape[dim] if dim == sdim else shape[sdim]
        if filled != expected:
            raise CheckpointError(f"{self.dir}: the pieces of {key} cover {filled} of "
                                  f"{expected} rows")
        return out


def check_fits(reader: CheckpointReader, model: nn.Module) -> None:
    """Raise CheckpointError unless the checkpoint has exactly the model's parameters and shapes."""
    have = {k for k in reader.tensors if not k.startswith("optimizer.")}
    want = dict(model.named_parameters())
    missing, extra = sorted(want.keys() - have), sorted(have - want.keys())
    if missing or extra:
        raise CheckpointError(f"{reader.dir} does not match the model: missing {missing[:4]}"
                              f"{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
                              f"{'...' if len(extra) > 4 else ''}")
    for name, p in want.items():
        saved = tuple(reader.tensors[name]["shape"])
        if saved != dense_shape(p):
            raise CheckpointError(f"{reader.dir}: {name} has shape {saved} in the checkpoint, "
                                  f"{dense_shape(p)} in the model")


@torch.no_grad()
def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    check_hashes: bool = True) -> dict:
    """Load weights (and AdamW moments) into this rank's shards; return the manifest.

    Reshards automatically: each parameter reads the dense slice its ``tp_shard`` names. No
    communication, so a bad checkpoint raises the same error on every rank. ``check_hashes``:
    compare each file's sha256 with the manifest (the CLI does it once, before the ranks start).
    """
    reader = CheckpointReader(path, check_hashes)
    check_fits(reader, model)
    groups = optimizer.param_groups if optimizer is not None else []
    group_of = {id(q): g for g in groups for q in g["params"]}
    for name, p in model.named_parameters():
        spec = p.tp_shard
        p.copy_(reader.read(name, spec.dim, spec.start, spec.stop))
        if optimizer is not None and f"optimizer.{ADAM_STATES[0]}.{name}" in reader.tensors:
            state = optimizer.state[p]
            for s in ADAM_STATES:
                state[s] = reader.read(f"optimizer.{s}.{name}", spec.dim, spec.start,
                                       spec.stop).to(p.device)
            # fused (and capturable) AdamW keep the step on the parameter's device, the others
            # on the CPU, as torch's own load_state_dict does
            group = group_of.get(id(p), {})
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.tensor(float(reader.manifest["step"]), dtype=torch.float32,
                                         device=p.device if on_device else "cpu")
    return reader.manifest | {"path": str(reader.dir)}


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
    _readable(tmp)
    os.replace(tmp, out_file)
    return out_file
