"""Loading a sharded checkpoint at any TP size (the format: ``format.py``).

Loading reads, for every parameter of the model being loaded, the dense slice its rank needs from
whichever files hold it, so a checkpoint saved at TP=2 resumes at TP=1 or 4. A fused dim (GPT-2's
q|k|v) is read block by block: the manifest's pieces are dense ranges, wherever they sit in a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tensorpar.checkpoint.format import (
    ADAM_STATES,
    FORMAT,
    VERSIONS,
    CheckpointError,
    checkpointed,
    checkpointed_buffers,
    find_checkpoint,
    is_dense_export,
    sha256_of,
)
from tensorpar.parallel.sharding import ShardSpec, dense_shape, param_shard
from tensorpar.runtime.dtensors import is_dtensor, local_part


class CheckpointReader:
    """Reads dense slices of a checkpoint's tensors, whatever TP size wrote it. Each file is
    checked against the manifest's sha256 the first time it is opened."""

    def __init__(self, path: str | Path, check_hashes: bool = True):
        self.check_hashes = check_hashes
        found = find_checkpoint(path)
        if found is None and is_dense_export(path):
            raise CheckpointError(f"{path} is an export (a dense safetensors file written by "
                                  "tensorpar export), not a checkpoint: give --ckpt the run "
                                  "directory it came from, or generate --hf a folder written by "
                                  "tensorpar export --hf-out")
        if found is None:
            raise CheckpointError(f"no checkpoint in {path} (expected manifest.json or "
                                  "step-*/manifest.json)")
        self.dir = found
        try:
            self.manifest = json.loads((found / "manifest.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{found}/manifest.json is corrupted: {e}") from None
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT or \
                m.get("version") not in VERSIONS:
            what = (f"format={m.get('format')!r}, version={m.get('version')!r}"
                    if isinstance(m, dict) else f"a JSON {type(m).__name__}")
            raise CheckpointError(f"{found}: not a {FORMAT} checkpoint of version "
                                  f"{' or '.join(map(str, VERSIONS))} ({what})")
        shape = {"tp_size": int, "step": int, "config": dict, "files": list, "tensors": dict}
        bad = [k for k, t in shape.items() if not isinstance(m.get(k), t)]
        if bad or len(m["files"]) != m["tp_size"] * m.get("pp_size", 1) * m.get("dp_size", 1):
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
            digest = sha256_of(path) if self.check_hashes or size != info["bytes"] else None
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
            at = piece.get("offset", 0) - a  # file row of dense row x: x + at
            if sdim is None:  # replicated: the whole tensor, in one file
                whole = src[:]
                return whole if dim is None else whole.narrow(dim, start, stop - start)
            if dim == sdim:  # the same split: read only the overlap
                lo, hi = max(a, start), min(b, stop)
                if lo >= hi:
                    continue
                index = (slice(None),) * dim + (slice(lo + at, hi + at),)
                out.narrow(dim, lo - start, hi - lo).copy_(src[index])
                filled += hi - lo
            else:  # another split dim (or the whole tensor): place the piece where it goes
                piece_t = src[(slice(None),) * sdim + (slice(a + at, b + at),)]
                if dim is not None:
                    piece_t = piece_t.narrow(dim, start, stop - start)
                out.narrow(sdim, a, b - a).copy_(piece_t)
                filled += b - a
        expected = shape[dim] if dim == sdim else shape[sdim]
        if filled != expected:
            raise CheckpointError(f"{self.dir}: the pieces of {key} cover {filled} of "
                                  f"{expected} rows")
        return out


def read_shard(reader: CheckpointReader, key: str, spec: ShardSpec) -> torch.Tensor:
    """What a parameter with ``spec`` holds of the saved tensor ``key``: each of its dense ranges
    (one per block of a fused dim, ``ShardSpec.ranges``), concatenated along the split dim."""
    if spec.dim is None:
        return reader.read(key)
    pieces = [reader.read(key, spec.dim, a, b) for a, b in spec.ranges()]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def check_fits(reader: CheckpointReader, model: nn.Module, part: bool = False) -> None:
    """Raise CheckpointError unless the checkpoint has exactly the model's parameters and shapes
    (``part``: the model is a pipeline rank's part, so the checkpoint holds more)."""
    have = {k for k in reader.tensors if not k.startswith("optimizer.")}
    want = dict(checkpointed(model))
    kept = {name for name, _ in checkpointed_buffers(model)}  # optional: see load_checkpoint
    missing = sorted(want.keys() - have)
    extra = [] if part else sorted(have - want.keys() - kept)
    if missing or extra:
        raise CheckpointError(f"{reader.dir} does not match the model: missing {missing[:4]}"
                              f"{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
                              f"{'...' if len(extra) > 4 else ''}")
    # the experts first: a checkpoint with another count of them differs in its routers too
    for name, p in sorted(want.items(), key=lambda item: not hasattr(item[1], "ep_shard")):
        saved, shape = tuple(reader.tensors[name]["shape"]), dense_shape(p)
        if saved != shape and hasattr(p, "ep_shard"):
            raise CheckpointError(f"{reader.dir}: {name} holds {saved[0]} experts of "
                                  f"{saved[1:]} in the checkpoint, the model {shape[0]} of "
                                  f"{shape[1:]}")
        if saved != shape:
            raise CheckpointError(f"{reader.dir}: {name} has shape {saved} in the checkpoint, "
                                  f"{shape} in the model")


def _place(tp_shard: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``tp_shard`` (the whole TP shard, read from the files) laid out as ``p`` is: on its
    device, and for an FSDP2 parameter (a DTensor split over data parallelism) as a DTensor of
    the same placements, each rank keeping its own piece (no communication: every rank read
    the whole shard)."""
    if is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(tp_shard.to(p.device), p.device_mesh, p.placements,
                                 src_data_rank=None)
    return tp_shard.to(p.device)


@torch.no_grad()
def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    check_hashes: bool = True, part: bool = False) -> dict:
    """Load weights (and AdamW moments) into this rank's shards; return the manifest.

    Reshards automatically: each parameter reads the dense slice its ``tp_shard`` (a routed
    expert's: ``ep_shard``, ``param_shard``) names, so experts saved at one EP size load at any. No
    communication, so a bad checkpoint raises the same error on every rank. A model wrapped by
    FSDP2 (``mesh/data_parallel.py``) loads too: each rank keeps its data-parallel piece of
    what it reads; a model in DDP is loaded through ``wrapped.module``. ``check_hashes``:
    compare each file's sha256 with the manifest (the CLI does it once, before the ranks start).
    ``part``: ``model`` is a pipeline rank's part of the saved model (its own tensors are read,
    whatever pipeline size saved them). The buffers a run moves (``checkpointed_buffers``: the
    MoE selection bias) are read whole on every rank.
    """
    reader = CheckpointReader(path, check_hashes)
    check_fits(reader, model, part)
    groups = optimizer.param_groups if optimizer is not None else []
    group_of = {id(q): g for g in groups for q in g["params"]}
    for name, p in checkpointed(model):
        spec = param_shard(p)
        local_part(p).copy_(local_part(_place(read_shard(reader, name, spec), p)))
        if optimizer is not None and f"optimizer.{ADAM_STATES[0]}.{name}" in reader.tensors:
            state = optimizer.state[p]
            for s in ADAM_STATES:
                state[s] = _place(read_shard(reader, f"optimizer.{s}.{name}", spec), p)
            # fused (and capturable) AdamW keep the step on the parameter's device, the others
            # on the CPU, as torch's own load_state_dict does
            group = group_of.get(id(p), {})
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.tensor(float(reader.manifest["step"]), dtype=torch.float32,
                                         device=p.device if on_device else "cpu")
    for name, b in checkpointed_buffers(model):  # whole on every rank; an older checkpoint
        if name in reader.tensors:  # without it leaves the model's
            b.copy_(reader.read(name))
    return reader.manifest | {"path": str(reader.dir)}
